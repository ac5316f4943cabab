"""Low-precision weight copies that autograd saves, made again in the backward (docs/distributed.md, "Memory per
rank").

A format pass runs each GEMM on a low-precision copy of its weight (CUDA autocast's cast; in emulated mode an
fp32 tensor holding the rounded values, precision_audit/emulation/rounding.py), and autograd keeps that copy for
the backward. FSDP2 frees a unit's unsharded parameters after its forward, but not these copies: by the end of the
forward a rank would hold a copy of every weight of the whole model (in emulated mode at fp32 size). Under FSDP2
:class:`RecomputingCounter` (the session's saved-tensor counter, precision_audit/capture/memory.py, with the same
counts; it also counts an FSDP unit's gathered parameters as parameters, not activations) keeps, instead of
such a copy, how to make it again from its parameter; the backward makes it again when
it needs it, once FSDP2 has gathered the unit's parameters again. The copy made again is checked, when it is
first replaced, to be bit for bit the one saved, so the gradients and every figure are unchanged.

At the end of each FSDP unit's forward the counter lets go of the copies it replaced (its registry of rounded
tensors kept them for address bookkeeping), so a rank holds the copies of one unit at a time.
"""

from __future__ import annotations

import weakref
from typing import Any, ClassVar

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .. import emulation
from ..capture.memory import SavedTensorCounter

_CASTS = ("ToCopyBackward0",)
_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def _source_parameter(fn: Any) -> torch.Tensor | None:
    """The leaf parameter ``fn`` casts (a chain of dtype conversions ending at its AccumulateGrad), else None."""
    for _ in range(4):
        if fn is None:
            return None
        name = type(fn).__name__
        if name == "AccumulateGrad":
            return fn.variable
        if name not in _CASTS or len(fn.next_functions) != 1:
            return None
        fn = fn.next_functions[0][0]
    return None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return False
    bits = _BITS.get(a.element_size())
    return bits is not None and torch.equal(a.view(bits), b.view(bits))


class _Recipe:
    """How to make a saved weight copy again: its parameter, the dtype chain, and the saved view's geometry."""

    __slots__ = ("param", "dtypes", "geometry")

    def __init__(self, param: torch.Tensor, dtypes: tuple[torch.dtype, ...], geometry: tuple | None) -> None:
        self.param = param
        self.dtypes = dtypes
        self.geometry = geometry

    def make(self) -> torch.Tensor:
        p = self.param
        if p.untyped_storage().nbytes() < p.numel() * p.element_size():
            raise RuntimeError("a saved weight copy is needed while its FSDP unit's parameters are not gathered "
                               "(docs/distributed.md, 'Memory per rank')")
        with torch.no_grad():
            out = p.detach()
            for d in self.dtypes:
                out = out.to(d)
        return out if self.geometry is None else out.as_strided(*self.geometry)


def recipe_of(t: torch.Tensor) -> _Recipe | None:
    """A recipe that makes ``t`` again, bit for bit, from its parameter; None when ``t`` is no such copy."""
    base = t._base if t._is_view() and t._base is not None else t
    p = _source_parameter(base.grad_fn)
    if p is None or base.storage_offset() != 0 or not base.is_contiguous() or not p.is_contiguous():
        return None
    geometry = None if base is t else (tuple(t.size()), tuple(t.stride()), t.storage_offset())
    chains: list[tuple[torch.dtype, ...]] = [(base.dtype,)]
    chains += [(low, base.dtype) for low in (torch.float16, torch.bfloat16) if low != base.dtype]
    with torch.no_grad():
        for dtypes in chains:
            r = _Recipe(p, dtypes, None)
            if _same_bits(r.make(), base):
                r.geometry = geometry
                return r
    return None


class RecomputingCounter(SavedTensorCounter):
    """The session's :class:`SavedTensorCounter` (same counts), saving parameter copies as recipes."""

    active: ClassVar[RecomputingCounter | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # storage address -> (a weak reference to the copy, whether every save of it was replaced by a recipe)
        self._replaced: dict[int, tuple[Any, bool]] = {}

    def __enter__(self) -> RecomputingCounter:
        super().__enter__()  # its hooks are this class's pack and unpack (which makes copies again)
        RecomputingCounter.active = self
        return self

    def __exit__(self, *exc: object) -> None:
        RecomputingCounter.active = None
        self._replaced.clear()
        super().__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> Any:
        base = t._base if t._is_view() and t._base is not None else t
        if isinstance(base, torch.nn.Parameter):  # an FSDP unit's gathered parameter: a parameter, not an
            return t  # activation (its storage is not the sharded one the counter knows)
        kept = super()._pack(t)
        try:
            ptr = t.untyped_storage().data_ptr()
        except Exception:
            return kept
        with _disable_current_modes():  # the audit's own ops: no op tracker or dispatch mode sees them
            recipe = recipe_of(t) if t.grad_fn is not None or t._is_view() else None
        if recipe is None:
            if ptr in self._replaced:
                self._replaced[ptr] = (self._replaced[ptr][0], False)
            return kept
        if ptr not in self._replaced:
            info = emulation.rounded_info(ptr)
            owner = info.tensor if info is not None else (t._base if t._base is not None else t)
            self._replaced[ptr] = (weakref.ref(owner), True)
        return recipe

    @staticmethod
    def _unpack(x: Any) -> torch.Tensor:
        if not isinstance(x, _Recipe):
            return SavedTensorCounter._unpack(x)
        with _disable_current_modes():
            return x.make()

    def release(self) -> None:
        """The end of an FSDP unit's forward: let go of the copies replaced so far, and forget their addresses
        once they are freed (a later tensor at the same address is another tensor, counted as such)."""
        rounded = emulation.drained_registry()  # the registry keeps each rounded tensor alive for its address
        for ptr, (ref, all_replaced) in list(self._replaced.items()):
            if not all_replaced:
                continue
            if rounded is not None:
                rounded.pop(ptr, None)
            if ref() is None:
                self._seen.discard(ptr)
                del self._replaced[ptr]


def _release(module: torch.nn.Module, args: Any, output: Any) -> None:
    counter = RecomputingCounter.active
    if counter is not None:
        counter.release()


def install(model: torch.nn.Module, undo: Any) -> None:
    """For the session's duration (``undo``: its ExitStack), when ``model`` has FSDP2 units: the capture session
    counts saved tensors with :class:`RecomputingCounter`, which lets go of a unit's copies after its forward."""
    from torch.distributed.fsdp import FSDPModule

    from ..capture import session as capture_session

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        return
    saved = capture_session.SavedTensorCounter
    setattr(capture_session, "SavedTensorCounter", RecomputingCounter)  # noqa: B010 - swapped for the audit
    undo.callback(setattr, capture_session, "SavedTensorCounter", saved)
    for unit in units:
        undo.callback(unit.register_forward_hook(_release).remove)
