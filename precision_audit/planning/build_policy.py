"""The policy an audit writes (policy.json), from its plan: per-module formats, loss scaling, TF32 switches (set
from the TF32 pass's measurement, with a reason).

It lives with the stage that builds the policy (planning/), so that the policy package stays data that knows no
planner or analysis type (docs/architecture.md); audit.py and the plan's verification (planning/verified.py) call
:func:`build_policy`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..formats import Format
from ..gpus import GpuSpec
from ..model_names import model_layout
from ..policy.schema import LossScaling, ModuleOverride, Policy
from ..version import __version__

if TYPE_CHECKING:
    from ..analysis.findings import FormatSummary
    from .rules import Plan

#: GradScaler's own initial scale (2**16), used when the audit found no FP16 gradients to derive one from.
DEFAULT_INIT_SCALE = 65536.0


def tf32_decision(target: GpuSpec, plan: Plan, tf32: FormatSummary | None) -> tuple[bool, str]:
    """(on, why) for the policy's two TF32 switches (cuBLAS matmuls, cuDNN convolutions), from the TF32 pass.

    TF32 is switched on only when this audit measured it (``--formats ...,tf32``) within the budget, or when the
    plan runs every module in TF32 (docs/plan.md, "TF32"). Both switches follow the same measurement: the TF32
    pass runs the model's GEMMs and convolutions on TF32 together.
    """
    if not target.supports("tf32"):
        return False, (f"off: {target.name} (compute capability {target.cc_string}) has no TF32 Tensor Cores "
                       "(TF32 needs Ampere, compute capability 8.0, or newer)")
    if plan.default_format is Format.TF32:
        return True, "on: the plan runs every module in tf32 (its own pass is within budget)"
    if tf32 is None:
        return False, ("off: not measured (add tf32 to --formats to measure it); fp32 GEMMs and convolutions stay "
                       "IEEE fp32")
    if tf32.error or not tf32.safe:
        return False, f"off: the TF32 pass is over budget: {tf32.verdict}"
    pins = sorted(n for n, o in plan.overrides.items() if o.format is Format.FP32 and "local error" in o.reason)
    if pins:
        return False, (f"off: the TF32 pass is within budget, but {len(pins)} module(s) are pinned to fp32 for their "
                       f"local error ({', '.join(pins[:3])}{' ...' if len(pins) > 3 else ''}); TF32 would round "
                       "their GEMM inputs")
    return True, f"on: the TF32 pass is within budget ({tf32.verdict.removeprefix('safe as is: ')})"


def build_policy(model: torch.nn.Module, fingerprint: str, n_modules: int, target: GpuSpec, plan: Plan,
                 recommended_scale: float | None, tf32: FormatSummary | None = None) -> Policy:
    """The policy of ``plan`` for ``model`` on ``target``.

    Loss scaling is on when any module runs in FP16, starting at ``recommended_scale`` (the loss scale found for
    the modules the plan runs in FP16; analysis/loss_scale.py) or GradScaler's default. The TF32 switches come
    from ``tf32``, the TF32 pass's summary (None when TF32 was not measured): :func:`tf32_decision`; its reason
    is written as policy.json's ``tf32_reason``.
    """
    uses_fp16 = plan.default_format is Format.FP16 or any(o.format is Format.FP16 for o in plan.overrides.values())
    on, why = tf32_decision(target, plan, tf32)
    return Policy(
        model_class=type(model).__name__,
        model_fingerprint=fingerprint,
        model_modules=n_modules,
        target_name=target.name,
        target_compute_capability=(target.compute_capability[0], target.compute_capability[1]),
        target_key=target.key,
        default_format=plan.default_format.value,
        modules={k: ModuleOverride(v.format.value, v.reason) for k, v in plan.overrides.items()},
        loss_scaling=LossScaling(enabled=uses_fp16, init_scale=recommended_scale or DEFAULT_INIT_SCALE),
        tf32_matmul=on,
        tf32_cudnn=on,
        tool_version=__version__,
        model_layout=model_layout(model),
        extra={"tf32_reason": why},
    )
