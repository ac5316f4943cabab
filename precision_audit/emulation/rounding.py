"""Casts and roundings the emulation's kernels share, and the registry of the fp32 tensors that hold rounded
fp16/bf16 values (the saved-activation counter, capture/memory.py, counts them at their real size).

``_round_up`` rounds a GEMM's operands and hands them on as fp32 (exact), registering each while a measurement
runs; the compiled kernels (compiled.py) keep their own list, drained into the registry when it is read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

from . import compiled

_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_COMPILED_ACTIVE = False  # one CudaAutocastPolicy at a time owns the compiled kernels' registrations


def _eligible(t: Any) -> bool:
    # CUDA autocast: defined, on the autocast device, floating point, not float64.
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 and t.device.type == "cpu"


def _cast_tree(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if _eligible(x) else x
    if isinstance(x, (list, tuple)):
        return type(x)(_cast_tree(v, dtype) for v in x)
    return x



class _Rounded:
    """What the memory counter needs to know about an fp32 tensor that holds fp16/bf16 values."""

    __slots__ = ("tensor", "itemsize", "from_parameter", "__weakref__")

    def __init__(self, tensor: torch.Tensor, itemsize: int, from_parameter: bool) -> None:
        self.tensor = tensor
        self.itemsize = itemsize
        self.from_parameter = from_parameter


# storage data_ptr -> _Rounded, only while a memory measurement runs (SavedTensorCounter: one forward pass).
# Keyed by storage so that views (a GEMM saves weight.t()) are recognised; the entry keeps the tensor alive,
# so the address cannot be reused while the registry exists.
_ROUNDED: dict[int, _Rounded] | None = None
_ITEMSIZE = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}


# The compiled kernels' control ops are torch ops: called under an active dispatch mode (the capture's op
# tracker, LowPrecisionGemmMode) they would be seen, and counted, as the model's own ops. They run with Python
# dispatch off.
def _set_compiled_recording(on: bool) -> None:
    if compiled.is_loaded():
        with torch._C._DisableTorchDispatch():
            compiled.ops().set_recording(on)


def _drain_compiled() -> None:
    """Move what the compiled kernels recorded into the registry (they keep their own list)."""
    if _ROUNDED is None or not _COMPILED_ACTIVE:
        return
    with torch._C._DisableTorchDispatch():
        tensors, itemsizes, from_parameter = compiled.ops().drain()
    for out, itemsize, param in zip(tensors, itemsizes, from_parameter):
        _ROUNDED[out.untyped_storage().data_ptr()] = _Rounded(out, itemsize, param)


def drained_registry() -> dict[int, _Rounded] | None:
    """The registry of rounded copies by storage address, with what the compiled kernels recorded moved in; None
    when no registry is running (distributed/saved.py forgets the copies an FSDP unit has let go)."""
    _drain_compiled()
    return _ROUNDED


def start_rounding_registry() -> dict[int, _Rounded]:
    global _ROUNDED
    _ROUNDED = {}
    _set_compiled_recording(True)
    return _ROUNDED


def stop_rounding_registry() -> None:
    global _ROUNDED
    _set_compiled_recording(False)
    _ROUNDED = None


def rounded_info(storage_ptr: int) -> _Rounded | None:
    """The registry's entry for a storage, if a rounding made it (None when no registry runs)."""
    if _ROUNDED is None:
        return None
    _drain_compiled()
    return _ROUNDED.get(storage_ptr)


@contextlib.contextmanager
def rounding_registry_paused() -> Iterator[None]:
    """No registration inside (e.g. a module re-run whose tensors are not part of the measured pass)."""
    global _ROUNDED
    _drain_compiled()
    saved, _ROUNDED = _ROUNDED, None
    if saved is not None:
        _set_compiled_recording(False)
    try:
        yield
    finally:
        _ROUNDED = saved
        if saved is not None:
            _set_compiled_recording(True)


def _register(src: torch.Tensor, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if _ROUNDED is not None:
        _ROUNDED[out.untyped_storage().data_ptr()] = _Rounded(out, _ITEMSIZE.get(dtype, 4),
                                                              src.is_leaf and src.requires_grad)
    return out


def _round_up(x: Any, dtype: torch.dtype) -> Any:
    """Round eligible tensors to ``dtype`` and hand them on as float32 (exact: every value is an fp32 value)."""
    if type(x) is torch.Tensor or isinstance(x, torch.Tensor):
        if x.dtype == dtype:
            return _register(x, x.float(), dtype)
        return _register(x, x.to(dtype).float(), dtype) if _eligible(x) else x
    if isinstance(x, (list, tuple)):
        return type(x)(_round_up(v, dtype) for v in x)
    return x


def _round_out(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):  # the common case, without a pytree walk
        return x.to(dtype) if x.dtype == torch.float32 else x
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t, x)
