"""A module's backward under the TF32 switches its forward ran under (docs/policy.md, "TF32 in the backward").

The switches (``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32`` or their
``fp32_precision`` equivalents) are global and read when a kernel is launched. :func:`precision_audit.apply_policy`
sets them around an fp32 / tf32 module's forward, and :func:`precision_audit.autocast` around the forward pass;
the backward runs later, outside both. So each such forward also leaves two marks in the autograd graph:

- an *exit* node, made before the module's first operation (from a 0-d leaf, the *anchor*; no input of the module
  is touched, so inputs that need no gradient, in-place operations on them and integer inputs all stay as they
  were), which restores the switches found when the module's backward began;
- an *enter* node on the module's floating outputs (a detached alias of each, no copy; an in-place operation on
  an output behaves as on the output itself), which saves the switches and sets the module's own, and passes the
  exit node a zero gradient so that it runs.

Why the exit node runs after every one of the module's backward operations and before anything earlier: the
autograd engine runs, among the nodes ready on one device, the one created last (the highest sequence number;
AccumulateGrad first), and a node only becomes ready once every node created after it that feeds it has run; so
on one device the backward runs in exactly the reverse order of creation. The module's nodes were created
between its exit node and its enter node, hence run between the two. A gradient restricted to some inputs
(``torch.autograd.grad(loss, inputs)``) may leave an exit node out of the graph task; then the switches are put
back when the backward ends (an engine callback), never left changed.

Under ``torch.compile`` (traced code) no marks are made: the compiled graph's kernels are chosen when it is
compiled. The outputs are looked for in tensors, tuples, lists and mappings (an HF ``ModelOutput``) of them; a
module whose forward returns none that needs a gradient in these is left unmarked (its backward runs under its
surroundings' switches), and logged once.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from ..tf32_switches import Tf32State, legacy_flags, restore, set_tf32, snapshot, tf32_enabled

log = logging.getLogger(__name__)

_ANCHORS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # device -> (0-d leaf, 0-d zero)
_PENDING: dict[int, list[_Cell]] = {}  # graph task -> cells whose backward set the switches (see _guard)
_UNMARKED: set[str] = set()
#: Models whose backward a controller runs under these switches (``controller.step``): their whole-model mark is
#: left out when the forward ran under the same ones (runtime/apply.py, _root_forward).
CONTROLLED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[bool, bool]] = weakref.WeakKeyDictionary()


def _anchor(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    got = _ANCHORS.get(device)
    if got is None:
        with torch.no_grad():
            leaf = torch.zeros((), device=device).requires_grad_()
            zero = torch.zeros((), device=device)
        got = _ANCHORS[device] = (leaf, zero)
    return got


def forward_state() -> tuple[str, bool] | Tf32State:
    """The switches in force now, as :class:`_Cell` takes them: the legacy flags when the program uses that API
    (cheap), else every setting."""
    flags = legacy_flags()
    return flags if flags is not None else snapshot()


def switch_to(want: bool | tuple[str, bool] | Tf32State) -> Tf32State | None:
    """Set the switches to ``want`` (``on`` for both, legacy flags, or a full state) if they differ; returns what
    to :func:`~precision_audit.tf32_switches.restore` after, or None when nothing changed."""
    if isinstance(want, bool):
        if tf32_enabled() == (want, want):
            return None
        saved = snapshot()
        set_tf32(want, want, legacy=saved.legacy is not None)
    elif isinstance(want, tuple):
        if legacy_flags() == want:
            return None
        saved = snapshot()
        torch.set_float32_matmul_precision(want[0])
        torch.backends.cudnn.allow_tf32 = want[1]
    else:
        saved = snapshot()
        if saved == want:
            return None
        restore(want)
    return saved


class _Cell:
    """One call's switches for its backward: ``want`` is ``on`` (both switches) for an fp32 / tf32 module, or the
    state the forward began in (the whole model's mark: :func:`forward_state`); ``saved`` what :meth:`enter`
    replaced, put back by :meth:`exit`."""

    __slots__ = ("saved", "want")

    def __init__(self, want: bool | tuple[str, bool] | Tf32State) -> None:
        self.want = want
        self.saved: Tf32State | None = None

    def enter(self) -> None:
        self.saved = switch_to(self.want)
        if self.saved is not None:
            _guard(self)

    def exit(self) -> None:
        saved, self.saved = self.saved, None
        if saved is not None:
            restore(saved)


def _guard(cell: _Cell) -> None:
    """Make sure the switches a backward set are put back when it ends, even where an exit node did not run."""
    task = torch._C._current_graph_task_id() if hasattr(torch._C, "_current_graph_task_id") else -1
    cells = _PENDING.get(task)
    if cells is None:
        cells = _PENDING[task] = []
        if len(_PENDING) > 64:  # tasks that raised before their callback: forget the oldest
            del _PENDING[next(iter(_PENDING))]

        def done() -> None:
            for c in reversed(_PENDING.pop(task, [])):  # innermost first: ends at the state before the backward
                c.exit()

        torch.autograd.Variable._execution_engine.queue_callback(done)
    cells.append(cell)


class _Exit(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, cell: _Cell, anchor: torch.Tensor) -> torch.Tensor:
        ctx.cell = cell
        ctx.set_materialize_grads(False)
        return anchor.detach()

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[None, None]:
        ctx.cell.exit()
        return None, None


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, cell: _Cell, token: torch.Tensor, zero: torch.Tensor,
                *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.cell = cell
        ctx.zero = zero
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        ctx.cell.enter()
        return (None, ctx.zero, None, *grads)


def _device_of(args: tuple, kwargs: dict, module: torch.nn.Module) -> torch.device | None:
    for v in args:
        if isinstance(v, torch.Tensor):
            return v.device
    for v in kwargs.values():
        if isinstance(v, torch.Tensor):
            return v.device
    for p in module.parameters():
        return p.device
    return None


def _marked(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point()


_DEPTH = 4  # how deep into tuples, lists and mappings the outputs are looked for


def _collect(out: Any, into: list[torch.Tensor], depth: int = 0) -> list[torch.Tensor]:
    """The floating tensors that need a gradient in ``out``: a tensor, or tuples, lists and mappings of them (an HF
    ``ModelOutput`` is a mapping), down to _DEPTH levels; other objects' tensors are not looked for."""
    if isinstance(out, torch.Tensor):
        if _marked(out):
            into.append(out)
    elif depth < _DEPTH and isinstance(out, (tuple, list)):
        for v in out:
            _collect(v, into, depth + 1)
    elif depth < _DEPTH and isinstance(out, Mapping):
        for v in out.values():
            _collect(v, into, depth + 1)
    return into


def _rebuild(out: Any, new: dict[int, torch.Tensor], depth: int = 0) -> Any:
    """``out`` with each collected tensor replaced by its alias: tuples (named ones too), lists and plain dicts are
    rebuilt; another mapping (an HF ModelOutput, whose items are also its attributes) is updated in place."""
    if isinstance(out, torch.Tensor):
        return new.get(id(out), out)
    if depth >= _DEPTH:
        return out
    if isinstance(out, tuple):
        items: list[Any] = [_rebuild(v, new, depth + 1) for v in out]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    if isinstance(out, list):
        return [_rebuild(v, new, depth + 1) for v in out]
    if type(out) is dict:
        return {k: _rebuild(v, new, depth + 1) for k, v in out.items()}
    if isinstance(out, MutableMapping):
        for k, v in list(out.items()):
            w = _rebuild(v, new, depth + 1)
            if w is not v:
                out[k] = w
    return out


def run_marked(want: bool | tuple[str, bool] | Tf32State, name: str, module: torch.nn.Module, args: tuple, kwargs: dict,
               call: Any) -> Any:
    """``call()`` (the module's forward) with its backward under ``want``'s switches (module docstring)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return call()
    device = _device_of(args, kwargs, module)
    if device is None:
        return call()
    leaf, zero = _anchor(device)
    cell = _Cell(want)
    token = _Exit.apply(cell, leaf)
    out = call()
    outs = _collect(out, [])
    if not outs:
        if out is not None and not isinstance(out, torch.Tensor) and name not in _UNMARKED:
            _UNMARKED.add(name)
            log.info("the backward of %r runs under its surroundings' TF32 switches: no tensor that needs a "
                     "gradient was found in the %s its forward returns", name or "(root)", type(out).__name__)
        return out
    marked = _Enter.apply(cell, token, zero, *outs)
    return _rebuild(out, {id(t): m for t, m in zip(outs, marked)})
