"""dL/dy of module outputs, also for an output that is a view a later op changes in place.

A tensor hook (``y.register_hook``) lives on ``y.grad_fn``. When ``y`` is a view — ``nn.Linear`` on a 3-D input
returns one, a view of its 2-D product — and a later op changes ``y`` in place, autograd *rebases* the view:
the base gets a ``CopySlices`` node and ``y`` a new ``AsStridedBackward0``, and the hook's node drops out of the
graph. The hook then never fires (the module gets no gradient statistics and no loss impact), or fires with the
gradient of the uses of ``y`` made before the change only: a partial, wrong dL/dy.

:class:`OutputGradHooks` registers the hook as before and remembers each view output. Once the forward and the
loss are done (:meth:`OutputGradHooks.settle`, before the backward) it looks at the graph: the views whose base's
producer now feeds a ``CopySlices`` were rebased. For such a view,

- when it covers its whole base in the base's own layout (``y`` is ``base.view(shape)``) and nothing but the view
  (before or after the change) consumes the base, the gradient arriving at the base's producer node *is* dL/dy of
  the value the module returned, reshaped: the hook moves there (a node pre-hook);
- otherwise the hook is removed and ``lost`` is called, so the record says "not measured" instead of keeping a
  partial gradient.

docs/memory.md ("Gradients of outputs changed in place") has the background.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

_CHAIN = 8  # how many single-input view nodes may lie between a view's own node and its base's producer


@dataclass
class _View:
    handle: Any  # the tensor hook's handle
    hook: Callable[[torch.Tensor], Any]
    lost: Callable[[], None] | None
    chain: list[Any]  # the view's own node, then each view node down to (not including) the base's producer
    base_node: Any
    base_nr: int
    shape: torch.Size
    whole: bool  # y is base.view(shape): every element of the base, in its order


class OutputGradHooks:
    """Tensor hooks on module outputs that survive in-place changes to view outputs (module docstring)."""

    def __init__(self) -> None:
        self._views: list[_View] = []

    def register(self, y: torch.Tensor, hook: Callable[[torch.Tensor], Any],
                 lost: Callable[[], None] | None = None) -> None:
        handle = y.register_hook(hook)
        if not y._is_view():
            return
        base = y._base
        if base is None or y.grad_fn is None or base.grad_fn is None:
            return
        chain, node = [y.grad_fn], y.grad_fn
        for _ in range(_CHAIN):
            nxt = node.next_functions
            if len(nxt) != 1 or nxt[0][0] is None:
                break
            node = nxt[0][0]
            if node is base.grad_fn:
                break
            chain.append(node)
        whole = (base.is_contiguous() and y.is_contiguous() and y.numel() == base.numel()
                 and y.storage_offset() == base.storage_offset())
        self._views.append(_View(handle, hook, lost, chain, base.grad_fn, base.output_nr, y.shape, whole))

    def settle(self, loss: torch.Tensor) -> bool:
        """Call after the forward and the loss, before the backward. Moves or removes the hooks of rebased views;
        returns whether any view was rebased (its hook, moved to a node, does not fire for the edges of
        ``torch.autograd.grad``, so the caller takes the whole backward)."""
        views, self._views = self._views, []
        if not views or loss.grad_fn is None:
            return False
        targets = {id(v.base_node) for v in views}
        consumers: dict[tuple[int, int], list[Any]] = {}
        for fn in autograd_nodes(loss):
            for nf, nr in fn.next_functions:
                if nf is not None and id(nf) in targets:
                    consumers.setdefault((id(nf), nr), []).append(fn)
        rebased = False
        for v in views:
            users = consumers.get((id(v.base_node), v.base_nr), [])
            if not any(type(u).__name__ == "CopySlices" for u in users):
                continue  # not changed in place (or not used): the tensor hook is right
            rebased = True
            v.handle.remove()
            own = {id(n) for n in v.chain}
            if v.whole and all(id(u) in own or type(u).__name__ == "CopySlices" for u in users):
                v.base_node.register_prehook(_at_base(v.hook, v.base_nr, v.shape))
            elif v.lost is not None:
                v.lost()
        return rebased


def autograd_nodes(loss: torch.Tensor) -> Iterator[Any]:
    """Every node of the graph behind ``loss``, once each."""
    # A node's Python object lives only while something holds it (torch 2.11 makes a new one per access once the
    # last is gone): the visited ones are held here, so that an id is never reused by another node mid-walk.
    seen: dict[int, Any] = {}
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen[id(fn)] = fn
        yield fn
        stack.extend(f for f, _ in fn.next_functions)


def _at_base(hook: Callable[[torch.Tensor], Any], nr: int, shape: torch.Size):
    def pre(grad_outputs: tuple) -> None:
        g = grad_outputs[nr]
        if g is not None:
            hook(g.reshape(shape))
    return pre
