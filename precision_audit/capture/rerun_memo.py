"""Re-runs that reuse their children's: a module's local re-run takes a child's output from the child's own re-run.

The reference pass re-runs every computing module alone in each format on its exact FP32 inputs
(capture/reference_pass.py). A module's re-run runs its children again, and a child that the module calls on
the module's *own inputs* (an attention block's q, k and v projections of its input; an MLP's first
projections; a ResNet block's first convolution and shortcut) sees exactly what it saw in its own re-run: the
same FP32 tensors, the same format, the same kernels, the same thread count, so it computes the same bits. Its
output from its own re-run is kept until the enclosing call ends and handed to the enclosing re-run instead of
computing it again (docs/performance.md, "Re-runs that reuse their children's").

It is handed over only when it is certain to be the same result, else the child runs as before:

- every argument of the child's call in the enclosing re-run is the very object of its reference call (tensors
  by identity and unchanged version; other values equal), and the enclosing module's inputs include all of the
  child's tensors (otherwise they are values the enclosing re-run computes anew, in low precision);
- the child's re-run drew no random numbers (the generator's state did not move), did not change its inputs in
  place, returned tensors (or tuples and lists of them) that share no memory with its inputs, and ran in
  emulated mode; the child carries no forward hooks but the audit's own, and no global module hooks are set
  (a hook could change the output after the forward, and would run again on the handed-over copy);
- autocast is on with the same dtype, grad mode is off and the fp32-fallback dispatch mode is as it was when
  the child re-ran.

The enclosing re-run gets a copy of the output (it may change it in place). Entries are dropped when the
outermost enclosing call that can use them ends, so at most the outputs of one block's first children per
format are held at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..formats import Format


@dataclass
class _Frame:
    """One module call on the reference forward's stack: its arguments as given, with their tensors' versions."""

    module: int
    args: tuple
    kwargs: dict
    tensors: list[torch.Tensor]
    versions: tuple[int, ...]
    ids: frozenset[int] = field(default_factory=frozenset)


@dataclass
class _Entry:
    fmt: Format
    args: tuple
    kwargs: dict
    versions: tuple[int, ...]
    output: Any
    context: tuple
    holder: int


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # a tensor without a plain storage (sparse, nested, a subclass): never kept
        return None


def _storable(out: Any) -> bool:
    if isinstance(out, torch.Tensor):
        return True
    if type(out) in (tuple, list):
        return all(v is None or _storable(v) for v in out)
    return False


def _copy(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if out is None:
        return None
    return type(out)(_copy(v) for v in out)


def _same(a: Any, b: Any) -> bool:
    """``a`` is ``b``'s very object (tensors), or an equal plain value (recursively for containers)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def plain_call(m: torch.nn.Module, own_hooks: set[int]) -> bool:
    """Whether calling ``m`` runs its forward and nothing else that could change the output: no forward hooks
    or pre-hooks on it but the audit's own (``own_hooks``: their handle ids), and no global module hooks."""
    from torch.nn.modules import module as _m

    if _m._global_forward_pre_hooks or _m._global_forward_hooks:
        return False
    return all(k in own_hooks for k in (*m._forward_pre_hooks, *m._forward_hooks))


def autocast_context() -> tuple:
    """What decides a CPU re-run's numerics besides its inputs: autocast's state and dtype, and grad mode."""
    return (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_grad_enabled())


class RerunMemo:
    """The re-run outputs that an enclosing module's re-run can reuse, and the reference forward's call stack."""

    def __init__(self, enabled: bool, root: torch.nn.Module) -> None:
        self.enabled = enabled
        self._root = id(root)
        self._frames: list[_Frame] = []
        self._entries: dict[int, list[_Entry]] = {}
        self.reused = 0  # re-runs of children taken from here (tests read it)

    def clear(self) -> None:
        self._frames.clear()
        self._entries.clear()

    def enter(self, m: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """A module call starts in the reference forward (its pre-hook)."""
        if not self.enabled:
            return
        ts = _tensors((args, kwargs))
        self._frames.append(_Frame(id(m), args, kwargs, ts, tuple(t._version for t in ts),
                                   frozenset(id(t) for t in ts)))

    def leave(self, m: torch.nn.Module) -> _Frame | None:
        """The call ends (its post-hook): its frame, or None when it is not the innermost one."""
        if not self.enabled or not self._frames or self._frames[-1].module != id(m):
            return None
        return self._frames.pop()

    def offer(self, frame: _Frame | None, fmt: Format, out: Any, rng_moved: bool, context: tuple) -> None:
        """The child whose call ``frame`` was re-ran in ``fmt`` and returned ``out``: kept if an enclosing re-run
        can reuse it (see the module's docstring; the caller checks the hooks)."""
        if frame is None or rng_moved or not frame.tensors or not _storable(out):
            return
        if tuple(t._version for t in frame.tensors) != frame.versions:  # the call changed its inputs in place
            return
        inputs = {_storage(t) for t in frame.tensors}
        if any(_storage(t) in inputs or _storage(t) is None for t in _tensors(out)):  # a view of an input
            return
        # the outermost enclosing call (not the model itself, which is never re-run) whose inputs hold all of
        # this call's tensors: every call between the two passes them on unchanged
        holder = next((f for f in self._frames if f.module != self._root and frame.ids <= f.ids), None)
        if holder is None:
            return
        self._entries.setdefault(frame.module, []).append(
            _Entry(fmt, frame.args, frame.kwargs, frame.versions, out, context, holder.module))

    def release(self, m: torch.nn.Module) -> None:
        """``m``'s call has ended: the entries only it could use go."""
        if not self._entries:
            return
        for key in list(self._entries):
            kept = [e for e in self._entries[key] if e.holder != id(m)]
            if kept:
                self._entries[key] = kept
            else:
                del self._entries[key]

    @contextlib.contextmanager
    def reusing(self, modules: dict[int, torch.nn.Module], rerun: torch.nn.Module, fmt: Format,
                context_extra: Any) -> Iterator[None]:
        """Around the re-run of ``rerun`` in ``fmt``: the modules with kept outputs answer from them when called
        as before."""
        patched: list[tuple[torch.nn.Module, bool, Any]] = []
        try:
            for key, entries in self._entries.items():
                mine = [e for e in entries if e.fmt is fmt]
                if mine and key != id(rerun):
                    m = modules[key]
                    had = "forward" in m.__dict__
                    patched.append((m, had, m.__dict__.get("forward")))
                    m.forward = self._answering(m.forward, mine, context_extra)
            yield
        finally:
            for m, had, old in reversed(patched):
                if had:
                    m.forward = old
                else:
                    del m.forward

    def _answering(self, forward: Any, entries: list[_Entry], context_extra: Any) -> Any:
        def answer(*args: Any, **kwargs: Any) -> Any:
            ctx = (*autocast_context(), context_extra)
            for e in entries:
                if e.context == ctx and _same(args, e.args) and _same(kwargs, e.kwargs) \
                        and tuple(t._version for t in _tensors((args, kwargs))) == e.versions:
                    self.reused += 1
                    return _copy(e.output)
            return forward(*args, **kwargs)
        return answer
