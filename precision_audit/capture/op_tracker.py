"""The reference forward's op tracker: which ops each module runs itself (not through its children).

It is a ``TorchDispatchMode`` active during the FP32 reference forward only (never during the local re-runs,
the format passes or the audit's own statistics). Per op it

- refuses, before it happens, a write into a parameter's storage (the audit keeps no copy of the parameters,
  docs/memory.md);
- counts the op under the innermost module running it, unless it only moves or relabels data: a module with
  ops of its own *computes*, and one whose own ops are additions only is a container that is not re-run
  (docs/memory.md, "Local re-runs");
- records GEMM-family ops with their shapes, and the elements every other op reads and writes, and the bytes
  it would move under fp16/bf16 autocast (capture/ops.py, ``AutocastWidths``), for the cost model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import ModelRunError
from .calls import CallStack
from .ops import AutocastWidths, ModuleOps, record_op
from .shards import local_tensor  # a rank's shard of an FSDP parameter (docs/distributed.md)

_aten = torch.ops.aten
# Ops that move or relabel data without computing: they do not make a module "compute".
_NON_COMPUTE = {
    _aten.detach.default, _aten.alias.default, _aten.clone.default, _aten._to_copy.default, _aten.copy_.default,
    _aten.empty_like.default, _aten.zeros_like.default, _aten.ones_like.default, _aten.new_empty.default,
    _aten.new_zeros.default, _aten.new_ones.default, _aten.lift_fresh.default, _aten._unsafe_view.default,
    _aten.empty.memory_format, _aten.zeros.default, _aten.ones.default, _aten.arange.start, _aten.arange.default,
    _aten.arange.start_step, _aten.full.default, _aten.scalar_tensor.default,
}
# A module's own ops that still leave it a container (not re-run alone): additions (a residual add).
_ADDS = {_aten.add.Tensor, _aten.add_.Tensor, _aten.add.Scalar, _aten.add_.Scalar}

_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}


def _written_args(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments ``func`` writes in place (from its schema; cached per op)."""
    hit = _WRITTEN.get(func)
    if hit is None:
        hit = _WRITTEN[func] = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                                     if a.alias_info is not None and a.alias_info.is_write)
    return hit


# what to do about the parameter writes real models make (the message's fix line)
_WRITE_HINTS = {
    "aten.embedding_renorm_.default":
        "nn.Embedding(max_norm=...) rescales the rows it looks up in place at every forward; build it with "
        "max_norm=None for the audit, after the rows are rescaled once if the weights should be those training "
        "sees (the rescaling runs outside autocast: in FP32 in every format)",
}


class OpTracker(TorchDispatchMode):
    """Counts compute ops per innermost module during the reference forward (the session's call stack, handed
    over as a :class:`~precision_audit.capture.session_state.CallStack`)."""

    def __init__(self, calls: CallStack, model: torch.nn.Module) -> None:
        super().__init__()
        self.calls = calls
        self.param_ptrs: set[int] = {local_tensor(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.widths = AutocastWidths()
        calls.outside_ops = ModuleOps()  # the ops outside every module (the loss), for the cost model

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: torch does not wrap :meth:`__torch_dispatch__` in ``torch._dynamo.disable``, whose first call
        imports Dynamo (1-3 s; capture/compile_stance.py). The tracker is on only inside the session, where the
        force_eager stance leaves nothing for Dynamo to compile, so the wrapper would change nothing."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        s = self.calls
        written = _written_args(func)
        if written and not s.rerunning:
            self._refuse_parameter_write(func, written, args, kwargs)
        out = func(*args, **kwargs)
        if s.rerunning:
            return out
        low_bytes, cast_bytes = self.widths.after(func, args, kwargs, out)
        if func.is_view or func in _NON_COMPUTE:
            return out
        if s.stack:
            s.own_ops[-1] += 1
            if func not in _ADDS:
                s.own_work[-1] += 1
            record_op(s.layer(s.modules[s.stack[-1]]).ops, func, args, kwargs, out, low_bytes, cast_bytes)
        else:  # the loss, computed on the model's output: part of the step, in no module's record
            record_op(s.outside_ops, func, args, kwargs, out, low_bytes, cast_bytes)
        return out

    def _refuse_parameter_write(self, func: Any, written: tuple[tuple[int, str], ...], args: tuple,
                                kwargs: dict) -> None:
        """Raise before an op writes into a parameter: the audit runs on the user's model and does not copy
        its parameters, so the write must not happen (docs/memory.md)."""
        s = self.calls
        for i, name in written:
            t = args[i] if i < len(args) else kwargs.get(name)
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.param_ptrs:
                where = s.names.get(s.stack[-1], "?") if s.stack else None
                raise ModelRunError(
                    f"the model writes into its own parameters during the forward pass ({func}), so passes in "
                    "different formats would not start from the same weights",
                    found=f"in module '{where or '(model)'}'" if where is not None else None,
                    hint=_WRITE_HINTS.get(str(func), "audit a model whose forward does not modify its parameters")
                    + "; the write was refused before it happened, so the model is unchanged")
