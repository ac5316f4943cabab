"""Typed records the capture stage hands to analysis: one :class:`LayerRecord` per module that ran."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..formats import Format
from .ops import ModuleOps
from .stats import ErrorStats, MagnitudeHistogram, RangeSummary


def float_tensors(obj: Any) -> list[torch.Tensor]:
    """Every floating-point tensor in a (nested) output, in a stable order."""
    out: list[torch.Tensor] = []
    _walk(obj, out)
    return out


def _walk(x: Any, out: list[torch.Tensor]) -> None:
    # a module-level function, not a closure calling itself: such a closure is a reference cycle that holds
    # the tensors it found until the cyclic garbage collector runs, activations a training step frees at once
    if isinstance(x, torch.Tensor):
        if x.is_floating_point():
            out.append(x)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _walk(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _walk(v, out)
    elif hasattr(x, "__dataclass_fields__"):
        for k in x.__dataclass_fields__:
            _walk(getattr(x, k, None), out)


@dataclass
class FormatLayerStats:
    """What one module did in one low-precision run."""

    accumulated: ErrorStats = field(default_factory=ErrorStats)
    local: ErrorStats | None = None
    local_note: str | None = None  # why local error is not measured, when it is not
    activation: RangeSummary = field(default_factory=RangeSummary)  # outputs as computed in p
    grad_output: RangeSummary = field(default_factory=RangeSummary)  # dL/dy in p, times loss scale
    grad_param_nonfinite: int = 0  # own parameters' non-finite gradient elements where FP32's are finite
    output_dtypes: set[str] = field(default_factory=set)
    calls: int = 0
    unmatched_calls: int = 0  # calls with no reference counterpart (control flow differed)
    # first-order change of the loss from this module's local error: sum over calls of <dL/dy, y_p - y>
    loss_impact: float = 0.0
    loss_impact_abs: float = 0.0
    impact_measured: bool = False


@dataclass
class LayerRecord:
    """One module (by its ``named_modules()`` path), its calls aggregated."""

    name: str
    type: str
    depth: int
    is_leaf: bool
    param_count: int  # own parameters (not children's)
    total_param_count: int  # own and children's
    order: int  # position of its first call in the reference forward
    calls: int = 0
    computes: bool = False  # ran at least one compute op itself (not only through children)
    own_ops: int = 0
    output_shapes: list[list[int]] = field(default_factory=list)
    activation: MagnitudeHistogram = field(default_factory=MagnitudeHistogram)  # fp32 reference outputs
    grad_output: MagnitudeHistogram = field(default_factory=MagnitudeHistogram)  # fp32 reference dL/dy
    grad_param: MagnitudeHistogram = field(default_factory=MagnitudeHistogram)  # fp32 reference dL/dW
    # For the FP16 loss scale (analysis/loss_scale.py, docs/report.md "Loss scale"): the reference dL/dy of
    # each output slot this module produced itself (not a child's output passed on, not the loss), the
    # modules that took that output as an input, the loss's own gradient dL/dL (kept apart), and dL/dW of
    # parameters it shares with a module they were attributed to first (tied weights).
    grad_output_own: dict[int, MagnitudeHistogram] = field(default_factory=dict)
    output_consumers: dict[int, set[str]] = field(default_factory=dict)
    grad_loss: MagnitudeHistogram = field(default_factory=MagnitudeHistogram)
    grad_param_tied: MagnitudeHistogram = field(default_factory=MagnitudeHistogram)
    formats: dict[Format, FormatLayerStats] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    ops: ModuleOps = field(default_factory=ModuleOps)  # what it computed itself in the FP32 forward
    saved_bytes: dict[str, int] = field(default_factory=dict)  # "fp32"/format -> activation bytes saved for backward
    measured_time_s: dict[str, float] = field(default_factory=dict)  # format -> instrumented time per step (inclusive)


@dataclass
class RunRecord:
    """One whole forward+backward pass in one format."""

    format: Format
    loss: float | None = None
    loss_scale: float = 1.0
    output: ErrorStats | None = None  # the model output vs the fp32 reference (None for the reference)
    output_nonfinite: int = 0
    param_grads_nonfinite: int = 0  # non-finite parameter-gradient elements where FP32's gradient is finite
    param_grads_nonfinite_shared: int = 0  # non-finite where FP32's gradient is not finite either
    error: str | None = None  # the model raised in this format: the run is not measured
    wall_s: float | None = None  # the instrumented pass, for progress only
    # FP16: each higher scale this pass ran at first whose backward overflowed with a finite forward, and its
    # non-finite parameter-gradient elements (audit.py backs off as GradScaler does; analysis/loss_scale.py)
    backoffs: list[tuple[float, int]] = field(default_factory=list)


@dataclass
class CaptureResult:
    mode: str  # "cuda" | "emulated"
    device: str
    formats: tuple[Format, ...]
    training: bool
    layers: list[LayerRecord]
    reference: RunRecord
    runs: dict[Format, RunRecord]
    grad_all: MagnitudeHistogram  # every gradient of the fp32 backward (module outputs and parameters)
    step_times_s: dict[str, list[float]]  # clean (uninstrumented) steps, per format incl. "fp32"
    emulation: dict[str, Any] | None
    warnings: list[str] = field(default_factory=list)
    # run -> {activation_bytes, weight_copy_bytes, peak_bytes?}
    memory: dict[str, dict[str, int]] = field(default_factory=dict)
    traces: dict[str, bytes] = field(default_factory=dict)  # file name -> profiler trace (for tb/)
    time_label: str = ""
    #: the ops the reference forward ran outside every module (the loss), for the cost model's step
    outside_ops: ModuleOps = field(default_factory=ModuleOps)
