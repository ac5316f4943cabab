"""The watch's model of FP8 delayed scaling (docs/policy.md, "FP8 delayed scaling").

A policy's ``fp8`` plan (fp8/policy.py) may put an ``nn.Linear`` under ``fp8_delayed``: Transformer Engine's
``DelayedScaling`` (HYBRID: E4M3 input and weight, E5M2 output gradient; a history of 1024 amaxes, ``max`` over it,
margin 0). That recipe quantises each tensor with the scale ``fp8_max / amax_history / 2^margin`` computed from
*earlier* steps, so a tensor whose amax rises from one step to the next by more than the format's rounding margin
(E4M3: 464/448, E5M2: 61440/57344) times 2^margin saturates: its largest values are clipped (fp8/quant.py,
``DelayedScaler``, models the recipe exactly and the audit measures its stale steps).

The runtime does not run FP8 itself (autocast has no FP8; the FP8 plan is applied through torchao, which has no
delayed scaling: fp8/apply.py refuses ``fp8_delayed``), so a run whose plan says ``fp8_delayed`` is the run a
Transformer Engine user makes from the same model in its high-precision format. The watch reads, for each module
planned ``fp8_delayed``, the amax of the three tensors the recipe scales (the input and the weight in the forward
hook, the output gradient in its tensor hook) and forecasts, per tensor, when the recipe would saturate:

- the series is the growth of log2 amax per step between consecutive readings; with ``max`` over a history that
  holds the previous step and an amax that rises, the recipe's scale at step s covers amax(s - 1), so the
  saturation condition amax(s) x scale(s) >= the format's overflow threshold is exactly "the growth per step
  exceeds log2(overflow / fp8_max) + margin" (:func:`saturation_limit`);
- that growth is fitted as a line over the recent readings (runtime/forecast.py): an amax growing at a steady
  rate below the limit is no threat, one whose growth *accelerates* crosses it at a forecast step.

When that crossing is within the horizon at the confidence asked, the watch changes the module's recipe in the
adapted policy's ``fp8`` plan to ``fp8_rowwise`` (current scaling: each step's own amax, which growth cannot
outrun; the issue's "a rowwise recipe") and records why. Nothing in the running model changes (it runs no FP8): the
plan is what the next FP8 run (``apply_fp8``, ``export``) reads.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from ..policy import Policy

#: The policy's FP8 plan key (fp8/policy.py; the runtime is a stage before fp8/ and reads the plain JSON).
KEY = "fp8"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
#: |x| from which a value scaled into the format rounds past its max (round to nearest even: E4M3's 464, the
#: midpoint of 448 and 480, rounds to 448; E5M2's 61440 rounds up): fp8/quant.py ``elem_overflow_from``, the same
#: values (tested).
OVERFLOW = {E4M3: float(torch.nextafter(torch.tensor(464.0), torch.tensor(math.inf))), E5M2: 61440.0}

#: The plan's recipe the watch models, and the one it moves a module to before the forecast saturation.
DELAYED, REPLACEMENT = "fp8_delayed", "fp8_rowwise"
#: Transformer Engine's DelayedScaling defaults (HYBRID format, margin 0; the history of 1024 holds the previous
#: step, which is all the saturation condition of a rising amax needs).
MARGIN = 0
#: The tensors the recipe scales: (the series key in the watch, the forecast kind, the element format).
ROLES = (("fp8_input", "saturation_input", E4M3), ("fp8_weight", "saturation_weight", E4M3),
         ("gradient", "saturation_grad_output", E5M2))
KINDS = {kind: (key, dtype) for key, kind, dtype in ROLES}


def delayed_modules(policy: Policy) -> set[str]:
    """The modules the policy's FP8 plan puts under delayed scaling."""
    modules = (policy.extra.get(KEY) or {}).get("modules") or {}
    return {n for n, m in modules.items() if isinstance(m, dict) and m.get("recipe") == DELAYED}


def saturation_limit(kind: str, margin: int = MARGIN) -> float:
    """The growth of log2 amax per step beyond which the delayed scale saturates (module docstring)."""
    dtype = KINDS[kind][1]
    return math.log2(OVERFLOW[dtype] / float(torch.finfo(dtype).max)) + margin


def growth_per_step(steps: list[float], log_amax: np.ndarray) -> tuple[list[float], np.ndarray]:
    """(the later step of each pair of consecutive readings, the growth of log2 amax per step between them);
    NaN where either reading is not finite."""
    if len(steps) < 2:
        return [], np.zeros(0)
    s = np.asarray(steps, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        rate = np.diff(log_amax) / np.diff(s)
    return list(steps[1:]), np.where(np.isfinite(rate), rate, np.nan)


def targets(logs: dict[str, np.ndarray], steps: list[float]) -> list[tuple[str, float, list[float], np.ndarray]]:
    """(kind, limit, steps, series) of a module planned ``fp8_delayed`` whose recent log2 amaxes are ``logs``."""
    out = []
    for key, kind, _ in ROLES:
        at, rate = growth_per_step(steps, logs[key])
        out.append((kind, saturation_limit(kind), at, rate))
    return out


def replan(policy: Policy, name: str, reason: str) -> Policy:
    """A copy of ``policy`` whose FP8 plan runs ``name`` under :data:`REPLACEMENT`, with ``reason``."""
    section: dict[str, Any] = dict(policy.extra.get(KEY) or {})
    section["modules"] = {**(section.get("modules") or {}), name: {"recipe": REPLACEMENT, "reason": reason}}
    return dataclasses.replace(policy, extra={**policy.extra, KEY: section})


def describe(kind: str, fc: Any, step: int) -> str:
    """The saturation forecast in words, for a reason and the log."""
    key, dtype = KINDS[kind]
    tensor = {"fp8_input": "its input", "fp8_weight": "its weight", "gradient": "its output gradient"}[key]
    fmt = "E4M3" if dtype == E4M3 else "E5M2"
    assert fc.step is not None
    span = (f", 95% interval {fc.low:.0f}-{fc.high:.0f}" if fc.low is not None and fc.high is not None
            else f", 95% interval from {fc.low:.0f}" if fc.low is not None else "")
    now = fc.intercept + fc.slope * step
    return (f"under fp8_delayed (Transformer Engine DelayedScaling, margin {MARGIN}) the amax of {tensor} grows "
            f"{now:+.4f} log2 per step, that growth rising {fc.slope:+.2e} per step (robust fit of {fc.points} "
            f"readings); forecast to "
            f"outrun the delayed {fmt} scale (growth {saturation_limit(kind):.4f} log2 per step: saturation) at "
            f"step {fc.step:.0f}{span}, {fc.step - step:.0f} steps ahead (confidence {fc.confidence:.2f} within "
            f"the horizon)")
