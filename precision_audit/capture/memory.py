"""Bytes the autograd graph keeps for backward, measured with ``saved_tensors_hooks`` during a forward.

Each saved tensor is counted once per storage and attributed to the innermost module running when it was
saved. Parameters (and views of them) are not activations and are left out; low-precision copies of
parameters (autocast's weight casts) are counted apart. In emulated mode the GEMM inputs are fp32 tensors
holding fp16/bf16 values (see emulation/rounding.py); they are registered there and counted at the size they have on
a GPU.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import emulation
from .shards import local_tensor


@dataclass
class SavedTally:
    activation_bytes: int = 0
    weight_copy_bytes: int = 0
    tensors: int = 0
    by_module: dict[int, int] = field(default_factory=dict)  # id(module) -> activation bytes


class _Saved:
    """A tensor saved for backward, with its version when it was saved.

    The graph holds it, and it holds the tensor: for a node's own output (``softmax``, ``log_softmax``, ``tanh``
    save theirs) that is a cycle through autograd's C++ objects (output -> its node -> the saved variable -> this
    -> output) that Python's collector cannot see. A backward frees it; a graph never run backward (the loss
    function's trial call that resolves the loss, outputs the loss does not use) was never freed, and with it
    its tensors, its nodes and the module hooks on them, which hold the capture session: after
    ``precision_audit.audit()`` returned, a logits-sized tensor stayed on the device and the session in memory
    for the life of the process. :meth:`SavedTensorCounter.release_saved` lets go of the tensors once the pass is
    over.
    """

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.version = tensor._version


class SavedTensorCounter:
    """Context manager counting the tensors saved for backward during a forward pass.

    Example::

        counter = SavedTensorCounter(model, current_module=lambda: None)
        with counter:
            loss = model(x).sum()
        counter.tally.activation_bytes
    """

    def __init__(self, model: torch.nn.Module, current_module: Callable[[], int | None]) -> None:
        self.tally = SavedTally()
        self._current = current_module
        self._param_ptrs = {local_tensor(p).untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: set[int] = set()
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._counting = False
        self._saved: weakref.WeakSet[_Saved] = weakref.WeakSet()

    def _pack(self, t: torch.Tensor) -> Any:
        self._count(t)
        saved = _Saved(t)
        self._saved.add(saved)
        return saved

    def release_saved(self) -> None:
        """After the pass's backward (or once it will not run): the tensors saved in its forward are let go, so
        that a graph no backward freed is freed too (:class:`_Saved`)."""
        for s in list(self._saved):
            s.tensor = None
        self._saved = weakref.WeakSet()

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        """The saved tensor, after the check autograd makes itself when no hooks are set and skips when they are:
        a tensor changed in place after it was saved raises, as it does in the user's training step, instead of
        giving a backward computed from the changed values."""
        if isinstance(saved, torch.Tensor):
            return saved
        t, version = saved.tensor, saved.version
        if t is None:
            raise RuntimeError("a tensor saved for backward in one of the audit's passes was used after the pass")
        if t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{t.type()} {list(t.shape)}] is at version {t._version}; expected version {version} instead "
                "(PyTorch raises the same in a training step of this model)")
        return t

    def _count(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
        except Exception:  # a tensor without storage (e.g. a subclass): nothing to count
            return
        if ptr in self._seen or ptr == 0:
            return
        self._seen.add(ptr)
        if ptr in self._param_ptrs:
            return
        nbytes = storage.nbytes()
        info = emulation.rounded_info(ptr) if self._counting else None
        if info is not None:
            nbytes = nbytes * info.itemsize // info.tensor.element_size()
            if info.from_parameter:
                self.tally.weight_copy_bytes += nbytes
                return
        elif _is_parameter_cast(t):
            self.tally.weight_copy_bytes += nbytes
            return
        self.tally.activation_bytes += nbytes
        self.tally.tensors += 1
        mid = self._current()
        if mid is not None:
            self.tally.by_module[mid] = self.tally.by_module.get(mid, 0) + nbytes

    def __enter__(self) -> SavedTensorCounter:
        emulation.start_rounding_registry()
        self._counting = True
        self._hooks = hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
        emulation.stop_rounding_registry()
        self._counting = False


def _is_parameter_cast(t: torch.Tensor) -> bool:
    """A cast of a leaf parameter (autocast's weight copy), or a view of one: CUDA autocast casts a linear
    layer's weight and the GEMM saves ``weight_cast.t()`` (TBackward0 -> ToCopyBackward0 -> AccumulateGrad);
    counted as a weight copy in cuda mode as in emulated mode (docs/gpu.md, "Memory figures")."""
    fn = t.grad_fn
    if t._is_view() and t._base is not None and t._base.grad_fn is not None:
        fn = t._base.grad_fn  # the tensor the view was taken of
    for _ in range(16):  # views of views (t, view, expand, ...) without a _base: follow the view nodes
        if fn is None or type(fn).__name__ not in _VIEW_NODES:
            break
        fn = fn.next_functions[0][0] if fn.next_functions else None
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    return any(nf is not None and type(nf).__name__ == "AccumulateGrad" for nf, _ in fn.next_functions)


# autograd nodes of view ops: a tensor saved through one of them still holds the storage of what it views
_VIEW_NODES = {"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "UnsafeViewBackward0",
               "ExpandBackward0", "AsStridedBackward0", "SliceBackward0", "SelectBackward0", "UnsqueezeBackward0",
               "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "AliasBackward0", "ReshapeAliasBackward0"}
