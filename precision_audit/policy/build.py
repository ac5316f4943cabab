"""The policy an audit writes (policy.json), from its plan: per-module formats, loss scaling, TF32 switches.

Not imported by ``precision_audit.policy`` itself (a training script that loads a policy does not pull in the
audit's planning); audit.py and the plan's verification (planning/verified.py) call :func:`build_policy`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import __version__
from ..formats import Format
from ..gpus import GpuSpec
from .schema import LossScaling, ModuleOverride, Policy, model_layout

if TYPE_CHECKING:
    from ..planning.rules import Plan

#: GradScaler's own initial scale (2**16), used when the audit found no FP16 gradients to derive one from.
DEFAULT_INIT_SCALE = 65536.0


def build_policy(model: torch.nn.Module, fingerprint: str, n_modules: int, target: GpuSpec, plan: Plan,
                 recommended_scale: float | None) -> Policy:
    """The policy of ``plan`` for ``model`` on ``target``.

    Loss scaling is on when any module runs in FP16, starting at ``recommended_scale`` (the loss scale found for
    the modules the plan runs in FP16; analysis/loss_scale.py) or GradScaler's default. TF32 stays on where the
    target has it, unless a module was pinned for its local error (TF32's rounding would undo the pin).
    """
    uses_fp16 = plan.default_format is Format.FP16 or any(o.format is Format.FP16 for o in plan.overrides.values())
    error_pins = any("local error" in o.reason for o in plan.overrides.values())
    tf32 = target.supports("tf32") and not error_pins
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
        tf32_matmul=tf32,
        tf32_cudnn=tf32,
        tool_version=__version__,
        model_layout=model_layout(model),
    )
