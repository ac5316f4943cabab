"""A parent's local re-run reuses what its children's re-runs computed (docs/memory.md, "Local re-runs").

The FP32 pass re-runs each module that computes something alone per format, at its call's post-hook
(capture/reference_pass.py, ``_rerun_alone``). A child's post-hook fires before its parent's, so when the parent
is re-run whole, its children run again inside it: the attention's re-run recomputes q/k/v_proj, the MLP's
gate/up_proj, on the very tensors (same objects, same versions) their own re-runs just took. Those calls give the
same bits as the child's re-run did, so the parent's re-run takes the child's re-run outputs instead.

A child's re-run outputs in a format are kept (:class:`ChildCall`, per call and format) when the call can be
replayed exactly: every tensor argument is one of the parent call's own tensor arguments (the only FP32 tensors a
parent's re-run hands its children again), the other arguments are plain values (no objects, nothing snapshotted
or copied for the call), it runs in the parent's own autocast region, the child and every module inside it hold
no buffers (a re-run swaps them for copies), no hooks but the session's, no compiled call, and only plain
attributes (no object whose contents a call could change), which the call did not rebind, and the re-run drew
no random numbers. They are handed to the parent's re-run in that format once (:func:`substituting`: the child's
``forward`` replaced on the instance for that re-run, put back in a ``finally``) when the call there matches: the
same tensor objects at the same versions, equal plain values, the random state the FP32 call started from, the
child's attributes as they were before it, the same fp32-fallback kernel mode, grad off, and the kept outputs
unchanged. Anything else is computed as before. What the parent's re-run did not take is freed after it, and the
rest at the parent's post-hook, whether it was re-run or not.
"""

from __future__ import annotations

import contextlib
import struct
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch.nn.modules import module as _module_globals

from ..formats import Format

_STANDARD = frozenset(torch.nn.Module().__dict__)  # what every module holds (its dicts, flags and hooks)
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")
_PLAIN = (bool, int, str, bytes, type(None), torch.dtype, torch.device, torch.Size, slice, type(Ellipsis))
_TENSOR = object()  # a tensor's place in a call's key
_MISSING = object()


class _NotPlain(Exception):
    pass


def call_key(args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> tuple | None:
    """The call's arguments as a comparable key, tensors as places (appended to ``tensors``); None when an
    argument is an object (anything but tensors, plain values and tuples, lists and dicts of them). Floats are
    keyed by their bits: 0.0 and -0.0 differ."""
    def walk(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return _TENSOR
        t = type(v)
        if t is float:
            return t, struct.pack("<d", v)
        if t is complex:
            return t, struct.pack("<dd", v.real, v.imag)
        if t in _PLAIN:
            return t, v
        if t is tuple or t is list:
            return t, tuple(walk(x) for x in v)
        if t is dict:
            return t, tuple((walk(k), walk(x)) for k, x in v.items())
        raise _NotPlain

    try:
        return walk(args), walk(kwargs)
    except _NotPlain:
        return None


def _plain_attribute(v: Any) -> bool:
    if type(v) in (*_PLAIN, float, complex) or isinstance(v, (types.FunctionType, types.BuiltinFunctionType)):
        return True
    return type(v) is tuple and all(_plain_attribute(x) for x in v)


def replayable_module(child: torch.nn.Module, own_hook: Callable[[Any], bool]) -> bool:
    """Whether a call of ``child`` gives the same outputs whenever its arguments, attributes and random state are
    the same (module docstring): no buffers, no hooks but the session's (``own_hook``), no compiled call, plain
    attributes only, in it and every module inside it, and no global module hooks."""
    if any(getattr(_module_globals, name, None) for name in _GLOBAL_HOOKS):
        return False
    for mod in child.modules():
        d = mod.__dict__
        # a compiled call, or a forward of the instance's own (a wrapper's: it may hold state in its closure)
        if isinstance(mod, torch.jit.ScriptModule) or d.get("_compiled_call_impl") is not None or "forward" in d:
            return False
        if any(b is not None for b in d.get("_buffers", {}).values()):
            return False
        for name in _HOOKS:
            if not all(own_hook(h) for h in d.get(name, {}).values()):
                return False
        if not all(_plain_attribute(v) for k, v in d.items() if k not in _STANDARD):
            return False
    return True


Attributes = list[tuple[torch.nn.Module, dict[str, Any]]]  # capture/model_state.py, module_attributes


def same_attributes(before: Attributes, after: Attributes) -> bool:
    """Whether a call left the attributes of every module inside its module as they were (the same objects): a call
    that rebinds one (a call counter) cannot be replaced by its outputs, which would leave its change undone."""
    return len(before) == len(after) and all(
        m is n and a.keys() == b.keys() and all(b[k] is v for k, v in a.items())
        for (m, a), (n, b) in zip(before, after))


def child_call(child: torch.nn.Module, args: tuple, kwargs: dict, rng: Any, attributes: Attributes,
               after: Attributes, parent_tensors: tuple[torch.Tensor, ...], parent_region: bool,
               own_hook: Callable[[Any], bool]) -> ChildCall | None:
    """A record of this call of ``child`` for its parent's re-runs, or None where they could not take its outputs
    (module docstring): an argument that is not one of the parent call's tensors (``parent_tensors``) or a plain
    value, another autocast region than the parent's (``parent_region`` False), attributes the call rebound, a
    module that is not replayable. ``rng``, ``attributes`` and ``after``: the random state and the attributes
    before the FP32 call, and the attributes after it."""
    tensors: list[torch.Tensor] = []
    key = call_key(args, kwargs, tensors)
    if key is None or not parent_region or not same_attributes(attributes, after):
        return None
    ids = {id(t) for t in parent_tensors}
    if not all(id(t) in ids for t in tensors) or not replayable_module(child, own_hook):
        return None
    return ChildCall(child, key, tensors, [t._version for t in tensors], rng, attributes)


@dataclass
class _Kept:
    out: Any  # the re-run's return value, as the module returned it
    versions: list[tuple[torch.Tensor, int]]  # its tensors with their versions: unchanged when handed over
    gemm_mode: bool  # whether the fp32-fallback dispatch mode was on (another mode computes other bits)


@dataclass
class ChildCall:
    """One call of a child whose re-run outputs its parent's re-run may take: the FP32 call's arguments (the
    tensors held: they are the parent call's own, alive until its post-hook anyway), the random state before it,
    the attributes it started from, and per format the re-run's outputs."""

    module: torch.nn.Module
    key: tuple
    tensors: list[torch.Tensor]
    versions: list[int]
    rng: Any  # the session's RngState before the FP32 call
    attributes: Attributes
    outputs: dict[Format, _Kept] = field(default_factory=dict)

    def keep(self, fmt: Format, out: Any, gemm_mode: bool) -> None:
        """Keep a re-run's return value, when it holds tensors and plain values only."""
        ts: list[torch.Tensor] = []
        if call_key((out,), {}, ts) is not None:
            self.outputs[fmt] = _Kept(out, [(t, t._version) for t in ts], gemm_mode)

    def matches(self, args: tuple, kwargs: dict) -> bool:
        """Whether a call with these arguments is the FP32 call's: same tensor objects at the same versions,
        equal plain values, and the module's attributes (those of every module inside it) as they were before."""
        ts: list[torch.Tensor] = []
        if call_key(args, kwargs, ts) != self.key or len(ts) != len(self.tensors):
            return False
        if any(a is not b or a._version != v for a, b, v in zip(ts, self.tensors, self.versions)):
            return False
        for mod, attrs in self.attributes:
            d = mod.__dict__
            ignore = "forward" if mod is self.module else None  # the substitute itself, while it is in place
            if sum(k != ignore for k in d) != sum(k != ignore for k in attrs):
                return False
            if any(attrs.get(k, _MISSING) is not v for k, v in d.items() if k != ignore):
                return False
        return True


class ChildReruns:
    """The kept re-run outputs of the calls inside each running call of the FP32 pass, keyed by that call
    (the parent's module and its depth on the call stack)."""

    #: off: every parent's re-run computes its children again (tests compare both)
    enabled: ClassVar[bool] = True

    def __init__(self) -> None:
        self.frames: dict[tuple[int, int], list[ChildCall]] = {}

    def clear(self) -> None:
        self.frames.clear()

    def add(self, parent: tuple[int, int], call: ChildCall) -> None:
        if call.outputs:
            self.frames.setdefault(parent, []).append(call)

    def take(self, parent: tuple[int, int]) -> list[ChildCall]:
        """The calls kept for ``parent``'s re-runs, no longer held here (freed once the caller lets go)."""
        return self.frames.pop(parent, [])


@contextlib.contextmanager
def substituting(calls: list[ChildCall], fmt: Format, same_state: Callable[[ChildCall, bool], bool]
                 ) -> Iterator[None]:
    """While a parent is re-run in ``fmt``: a call of one of ``calls``' modules that matches a kept call returns
    that call's outputs (once); ``same_state`` checks what the session knows (random state, kernel mode). The
    modules' ``forward`` are put back in a ``finally``; the outputs not taken are freed on exit."""
    by_module: dict[int, list[ChildCall]] = {}
    for c in calls:
        if fmt in c.outputs:
            by_module.setdefault(id(c.module), []).append(c)
    patched: list[tuple[torch.nn.Module, bool, Any]] = []
    try:
        for group in by_module.values():
            mod = group[0].module
            d = mod.__dict__
            patched.append((mod, "forward" in d, d.get("forward")))
            d["forward"] = _substitute(group, fmt, mod.forward, same_state)
        yield
    finally:
        for mod, had, saved in reversed(patched):
            if had:
                mod.__dict__["forward"] = saved
            else:
                mod.__dict__.pop("forward", None)
        for c in calls:
            c.outputs.pop(fmt, None)


def _substitute(group: list[ChildCall], fmt: Format, original: Callable[..., Any],
                same_state: Callable[[ChildCall, bool], bool]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            for c in group:
                kept = c.outputs.get(fmt)
                if kept is None or any(t._version != v for t, v in kept.versions):
                    continue
                if c.matches(args, kwargs) and same_state(c, kept.gemm_mode):
                    del c.outputs[fmt]
                    return kept.out
        return original(*args, **kwargs)
    return forward
