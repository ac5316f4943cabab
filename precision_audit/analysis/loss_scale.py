"""FP16 loss scaling from the measured gradient distribution (NUMERICS.md §6).

All counts are exact: the gradient histogram has an edge at every FP16 rounding threshold divided by every
candidate scale 2^k, so "how many gradients overflow / flush to zero at scale 2^k" is read, not estimated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..capture.stats import SCALE_EXPONENTS, MagnitudeHistogram
from ..formats import Format

# torch.amp.GradScaler defaults (torch/amp/grad_scaler.py, torch 2.13).
GRADSCALER_INIT_EXPONENT = 16
GRADSCALER_GROWTH_INTERVAL = 2000
# Keep one power of two between the largest gradient and FP16's max: gradients spike during training.
HEADROOM_EXPONENTS = 1
# A scale range is "safe" while the flushed share stays within this of the best one reachable.
UNDERFLOW_TOLERANCE = 1e-4
# Above this flushed share at the best safe scale, FP16 cannot represent the gradients: use BF16.
MAX_UNDERFLOW_FRACTION = 1e-2


@dataclass(frozen=True)
class LossScaleFinding:
    """The loss scale to use for FP16 and why.

    ``recommended_exponent`` k means an init scale of 2^k; ``safe_range`` is (lo, hi) exponents.
    """

    max_abs_grad: float
    forward_overflow: str | None
    max_no_overflow_exponent: int | None
    recommended_exponent: int | None
    safe_range: tuple[int, int] | None
    flushed_unscaled: float
    flushed_at_recommended: float | None
    overflow_unscaled: float
    default_skipped_steps: int | None
    gradscaler_settles_exponent: int | None
    viable: bool
    reason: str

    @property
    def recommended_scale(self) -> float | None:
        return None if self.recommended_exponent is None else math.ldexp(1.0, self.recommended_exponent)

    def to_dict(self) -> dict:
        every_step = self.forward_overflow is not None
        return {
            "recommended_init_scale": self.recommended_scale,
            "recommended_exponent": self.recommended_exponent,
            # scales with one doubling of headroom below overflow whose flushed share is within
            # UNDERFLOW_TOLERANCE of the best reachable
            "safe_range": None if self.safe_range is None else [math.ldexp(1.0, e) for e in self.safe_range],
            "max_no_overflow_scale": None if self.max_no_overflow_exponent is None
            else math.ldexp(1.0, self.max_no_overflow_exponent),
            "max_abs_grad": self.max_abs_grad,
            "flushed_fraction": {"unscaled": self.flushed_unscaled, "at_recommended": self.flushed_at_recommended},
            "overflow_fraction": {"unscaled": self.overflow_unscaled,
                                  "at_recommended": 0.0 if self.recommended_exponent is not None else None},
            "forward_overflow": self.forward_overflow,
            "expected_skipped_steps": None if every_step else 0,
            "every_step_skipped": every_step,
            "gradscaler_default": {
                "init_scale": math.ldexp(1.0, GRADSCALER_INIT_EXPONENT),
                "skipped_steps": self.default_skipped_steps,
                "settles_at": None if self.gradscaler_settles_exponent is None
                else math.ldexp(1.0, self.gradscaler_settles_exponent),
            },
            "viable": self.viable,
            "reason": self.reason,
        }


def recommend_loss_scale(grads: MagnitudeHistogram, forward_overflow: str | None = None) -> LossScaleFinding:
    """Recommend an FP16 GradScaler init scale from every gradient of the FP32 backward.

    ``forward_overflow`` names a module whose FP16 forward overflows: then no scale helps, every step is
    skipped until that module runs in a wider format.

    Example::

        finding = recommend_loss_scale(capture.grad_all)
        scaler = torch.amp.GradScaler("cuda", init_scale=finding.recommended_scale)
    """
    def frac(k: int) -> dict[str, float]:
        return grads.fractions(Format.FP16, k)

    g = grads.amax
    unscaled = frac(0)
    if grads.nonzero_finite == 0:
        return LossScaleFinding(g, forward_overflow, None, None, None, 0.0, None, 0.0, None, None,
                                forward_overflow is None, "no non-zero gradient was measured; any scale works")
    no_overflow = [k for k in SCALE_EXPONENTS if grads.count_at_or_above(_edge(k)) == 0 and g * 2.0**k < 65504]
    if not no_overflow:
        return LossScaleFinding(g, forward_overflow, None, None, None, unscaled["flushed"], None, unscaled["overflow"],
                                None, None, False,
                                f"gradients reach {g:.3g}: they overflow FP16 even at scale 2^{SCALE_EXPONENTS[0]}; use BF16")
    k_max = max(no_overflow)  # largest scale with no overflow at all
    k_hi = k_max - HEADROOM_EXPONENTS
    if k_hi < SCALE_EXPONENTS[0]:
        k_hi = k_max
    best = frac(k_hi)["flushed"]
    k_lo = min(k for k in SCALE_EXPONENTS if k <= k_hi and frac(k)["flushed"] - best <= UNDERFLOW_TOLERANCE)
    skipped = 0
    while GRADSCALER_INIT_EXPONENT - skipped > k_max:
        skipped += 1
    viable = best <= MAX_UNDERFLOW_FRACTION and forward_overflow is None
    if forward_overflow is not None:
        reason = (f"the FP16 forward pass overflows in '{forward_overflow}', so every step would be skipped whatever "
                  f"the scale; keep that module out of FP16 (or use BF16). For the gradients alone, 2^{k_hi} is best")
    elif best > MAX_UNDERFLOW_FRACTION:
        reason = (f"{best:.1%} of gradients still flush to zero at the largest safe scale 2^{k_hi} "
                  f"(largest gradient {g:.3g}); FP16 cannot hold this gradient range, use BF16")
    else:
        reason = (f"largest gradient {g:.3g}: scales up to 2^{k_max} do not overflow (2^{k_hi} keeps one doubling of "
                  f"headroom); from 2^{k_lo} the flushed share is within {UNDERFLOW_TOLERANCE:g} of its minimum "
                  f"({best:.2e}); unscaled, {unscaled['flushed']:.2%} of gradients flush to zero")
    return LossScaleFinding(
        max_abs_grad=g,
        forward_overflow=forward_overflow,
        max_no_overflow_exponent=k_max,
        recommended_exponent=k_hi,
        safe_range=(k_lo, k_hi),
        flushed_unscaled=unscaled["flushed"],
        flushed_at_recommended=best,
        overflow_unscaled=unscaled["overflow"],
        default_skipped_steps=None if forward_overflow else skipped,
        gradscaler_settles_exponent=None if forward_overflow else min(k_max, GRADSCALER_INIT_EXPONENT) if skipped else GRADSCALER_INIT_EXPONENT,
        viable=viable,
        reason=reason,
    )


def _edge(k: int) -> float:
    from ..formats import SPECS

    return math.ldexp(SPECS[Format.FP16].overflow_from, -k)
