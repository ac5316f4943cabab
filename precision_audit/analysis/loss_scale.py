"""FP16 loss scaling from the measured gradient distribution (docs/report.md, "Loss scale").

All counts are exact: the gradient histogram has an edge at every FP16 rounding threshold divided by every
candidate scale 2^k, so "how many gradients overflow / flush to zero at scale 2^k" is read, not estimated.

Only gradients that are computed in FP16 constrain the scale (:func:`fp16_gradients`):

- the gradient of a module output, when the module producing it or a module taking it as an input runs in
  FP16 (autocast casts an FP32 input of an FP16 op to FP16, so its gradient is an FP16 tensor too);
- the parameter gradients of a module whose own GEMMs (linear, matmul, convolution) run in FP16: autocast
  casts the weight to FP16 and the GEMM's backward computes dW in FP16 (a tied weight counts when any module
  using it does);
- never the loss's own gradient dL/dL = 1 (an FP32 scalar: autocast runs losses in FP32), nor parameter
  gradients of modules without a GEMM (norms, embeddings: FP32 under autocast).

Before the plan exists the whole model is taken as FP16 (the uniform FP16 pass); :meth:`LossScaleFinding.for_plan`
re-derives the scale from the modules the plan runs in FP16, so modules kept in FP32/BF16 do not constrain it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from ..capture.records import LayerRecord, RunRecord
from ..capture.stats import SCALE_EXPONENTS, MagnitudeHistogram
from ..formats import SPECS, Format
from .histograms import Counts

# torch.amp.GradScaler defaults (torch/amp/grad_scaler.py, torch 2.13).
GRADSCALER_INIT_EXPONENT = 16
GRADSCALER_GROWTH_INTERVAL = 2000
# Keep one power of two between the largest gradient and FP16's max: gradients spike during training.
HEADROOM_EXPONENTS = 1
# A scale range is "safe" while the flushed share stays within this of the best one reachable.
UNDERFLOW_TOLERANCE = 1e-4
# Above this flushed share at the best safe scale, FP16 cannot represent the gradients: use BF16.
MAX_UNDERFLOW_FRACTION = 1e-2


# GEMM kinds whose weights autocast casts to FP16 (capture/ops.py); "attention" has no weights of its own.
_WEIGHT_GEMM_KINDS = ("matmul", "conv")


@dataclass(frozen=True)
class Fp16Gradients:
    """The gradients computed in FP16 under one assignment of formats, merged, and where they come from."""

    histogram: MagnitudeHistogram
    basis: str  # "uniform fp16" (every module in FP16) or "plan"
    activation_modules: int  # modules whose output gradients were counted
    parameter_modules: int  # modules whose parameter gradients were counted
    largest_in: str | None  # "'h.0.mlp.fc' output gradient", where the largest one was measured
    loss_gradient_excluded: float | None  # |dL/dL| of the loss's own gradient, left out (None: not seen)
    modules_not_fp16: int  # modules with gradients that the assignment keeps out of FP16

    def to_dict(self) -> dict[str, Any]:
        return {"basis": self.basis, "elements": self.histogram.total,
                "activation_modules": self.activation_modules, "parameter_modules": self.parameter_modules,
                "largest_in": self.largest_in, "loss_gradient_excluded": self.loss_gradient_excluded,
                "modules_not_fp16": self.modules_not_fp16}


def _label(name: str) -> str:
    return f"'{name}'" if name else "the model's output"


def fp16_gradients(layers: Iterable[LayerRecord], fp16_modules: Collection[str] | None = None) -> Fp16Gradients:
    """Merge the reference gradients computed in FP16 when the modules in ``fp16_modules`` run in FP16
    (``None``: every module, the uniform FP16 pass). Rules in this module's docstring."""
    hist = MagnitudeHistogram()
    act = par = outside = 0
    largest, where = 0.0, None
    loss_grad: float | None = None

    def fp16(name: str) -> bool:
        return fp16_modules is None or name in fp16_modules

    for r in layers:
        if r.grad_loss.total:
            loss_grad = max(loss_grad or 0.0, r.grad_loss.amax)
        counted = False
        for slot, h in r.grad_output_own.items():
            if fp16(r.name) or any(fp16(c) for c in r.output_consumers.get(slot, ())):
                hist.merge(h)
                counted = True
                if h.amax > largest:
                    largest, where = h.amax, f"{_label(r.name)} output gradient"
        act += counted
        has_weight_gemm = any(g.kind in _WEIGHT_GEMM_KINDS for g, _ in r.ops.gemms.values())
        params = [h for h in (r.grad_param, r.grad_param_tied) if h.total]
        if params and has_weight_gemm and fp16(r.name):
            par += 1
            for h in params:
                hist.merge(h)
                if h.amax > largest:
                    largest, where = h.amax, f"{_label(r.name)} parameter gradient"
        elif (params and has_weight_gemm) or (r.grad_output_own and not counted):
            outside += 1
    return Fp16Gradients(hist, "uniform fp16" if fp16_modules is None else "plan", act, par, where, loss_grad,
                         outside)


def forward_overflow_in(layers: Iterable[LayerRecord], fp16_modules: Collection[str] | None = None) -> str | None:
    """The first module (in execution order) running in FP16 whose FP32 outputs overflow FP16."""
    for r in layers:
        if r.name and (fp16_modules is None or r.name in fp16_modules) and \
                r.activation.fractions(Format.FP16)["overflow"] > 0:
            return r.name
    return None


@dataclass(frozen=True)
class BackwardOverflow:
    """What the uniform FP16 pass itself measured when its backward overflowed with a finite forward at the scale
    the histograms chose (a gradient inside a module, which no module outputs, beyond FP16's range: the FP32
    histograms cannot see it). The audit then tried lower scales (audit.py, ``_back_off``); each scale tried and
    its non-finite parameter-gradient elements. ``finite_at``: the largest scale at which the backward was finite,
    and so the largest counted free of overflow (None: finite at no scale down to 2^-24, so the overflow is not the
    scale's doing, and nothing is capped)."""

    scales: tuple[float, ...]  # every scale the FP16 pass ran at, in order
    nonfinite_param_grads: tuple[int, ...]  # non-finite parameter-gradient elements at each (0: finite)

    @property
    def finite_at(self) -> float | None:
        finite = [s for s, n in zip(self.scales, self.nonfinite_param_grads) if n == 0]
        return max(finite) if finite else None

    @property
    def max_exponent(self) -> int | None:
        """The largest scale exponent counted free of overflow (None: no cap)."""
        f = self.finite_at
        return None if f is None else math.floor(math.log2(f))

    def to_dict(self) -> dict[str, Any]:
        return {"scales": list(self.scales), "nonfinite_param_grads": list(self.nonfinite_param_grads),
                "finite_at": self.finite_at}


def backward_overflow(run: RunRecord | None) -> BackwardOverflow | None:
    """The FP16 pass's measured backward overflows (``RunRecord.backoffs``), or None when it had none."""
    if run is None or not run.backoffs:
        return None
    return BackwardOverflow(tuple(s for s, _ in run.backoffs), tuple(n for _, n in run.backoffs))


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
    gradients: Fp16Gradients | None = None  # which gradients the scale was derived from
    uniform: LossScaleFinding | None = None  # for a plan's finding: the uniform FP16 pass's one
    backward_overflow: BackwardOverflow | None = None  # what the FP16 pass measured beyond the histograms
    layers: tuple[LayerRecord, ...] = field(default=(), repr=False, compare=False)  # to re-derive for a plan

    def for_plan(self, plan: Any) -> LossScaleFinding:
        """The same recommendation from the gradients the plan computes in FP16 (``plan.layers[name].format``,
        the default format for modules it does not list). Returns ``self`` when the plan runs nothing in
        FP16 (no loss scaling is needed then), or when this finding has no layer records."""
        if not self.layers or self.uniform is not None:
            return self
        default = getattr(plan, "default_format", None)
        planned = getattr(plan, "layers", {}) or {}
        fp16 = {r.name for r in self.layers
                if (planned[r.name].format if r.name in planned else default) is Format.FP16}
        if not fp16:
            return self
        grads = fp16_gradients(self.layers, fp16)
        # the measured overflow applies to the plan too: which module held that gradient is not known
        found = recommend_loss_scale(grads.histogram, forward_overflow_in(self.layers, fp16), gradients=grads,
                                     backward_overflow=self.backward_overflow)
        return replace(found, uniform=self, layers=self.layers)

    @property
    def recommended_scale(self) -> float | None:
        return None if self.recommended_exponent is None else math.ldexp(1.0, self.recommended_exponent)

    def to_dict(self, plan: Any = None) -> dict:
        """audit.json's ``loss_scale``; with ``plan``, its ``plan`` key holds :meth:`for_plan`'s finding (null
        when the plan runs no module in FP16: no loss scaling then)."""
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
            "gradients": self.gradients.to_dict() if self.gradients else None,
            "backward_overflow": self.backward_overflow.to_dict() if self.backward_overflow else None,
            **({} if plan is None else {"plan": self._plan_dict(plan)}),
        }

    def _plan_dict(self, plan: Any) -> dict | None:
        found = self.for_plan(plan)
        return None if found is self else found.to_dict()


def recommend_fp16_loss_scale(layers: Iterable[LayerRecord], forward_overflow: str | None = None,
                              backward_overflow: BackwardOverflow | None = None) -> LossScaleFinding:
    """The loss scale for the uniform FP16 pass, from the gradients it computes in FP16 (:func:`fp16_gradients`);
    ``forward_overflow`` and ``backward_overflow`` as in :func:`recommend_loss_scale`. Re-derive for a plan with
    ``finding.for_plan(plan)``.

    Example::

        finding = recommend_fp16_loss_scale(capture.layers, forward_overflow_in(capture.layers))
        scaler = torch.amp.GradScaler("cuda", init_scale=finding.for_plan(plan).recommended_scale)
    """
    layers = tuple(layers)
    grads = fp16_gradients(layers)
    return replace(recommend_loss_scale(grads.histogram, forward_overflow, gradients=grads,
                                        backward_overflow=backward_overflow), layers=layers)


def recommend_loss_scale(grads: MagnitudeHistogram, forward_overflow: str | None = None,
                         gradients: Fp16Gradients | None = None,
                         backward_overflow: BackwardOverflow | None = None) -> LossScaleFinding:
    """Recommend an FP16 GradScaler init scale from the gradients in ``grads`` (FP32 reference values).

    ``gradients`` says which ones they are (:func:`fp16_gradients`): it is carried into the finding and its reason.

    ``backward_overflow``: the scales at which the FP16 pass's own backward overflowed with a finite forward; no
    scale at or above the lowest of them counts as free of overflow.

    ``forward_overflow`` names a module whose FP16 forward overflows: then no scale helps, every step is
    skipped until that module runs in a wider format.

    Example::

        finding = recommend_loss_scale(fp16_gradients(capture.layers).histogram)
        scaler = torch.amp.GradScaler("cuda", init_scale=finding.recommended_scale)
    """
    counts = Counts(grads)  # read once: a fraction at each of up to 73 scales (analysis/histograms.py)

    def frac(k: int) -> dict[str, float]:
        return counts.fractions(Format.FP16, k)

    g = grads.amax
    unscaled = frac(0)
    basis = _basis_text(gradients)
    if counts.nonzero_finite == 0 and backward_overflow is None:
        return _no_gradient_finding(grads, forward_overflow, gradients)
    fp16_max = SPECS[Format.FP16].max
    measured = f" and {_measured_text(backward_overflow)}" if backward_overflow else ""
    cap = backward_overflow.max_exponent if backward_overflow is not None else None
    no_overflow = [k for k in SCALE_EXPONENTS if counts.count_at_or_above(_edge(k)) == 0 and g * 2.0**k < fp16_max
                   and (cap is None or k <= cap)]
    if not no_overflow:
        return LossScaleFinding(g, forward_overflow, None, None, None, unscaled["flushed"], None, unscaled["overflow"],
                                None, None, False,
                                f"gradients reach {g:.3g}{_where(gradients)}{measured}: they overflow FP16 even at "
                                f"scale 2^{SCALE_EXPONENTS[0]}; use BF16" + basis, gradients=gradients,
                                backward_overflow=backward_overflow)
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
                  f"(largest gradient {g:.3g}{_where(gradients)}{measured}); FP16 cannot hold this gradient range, "
                  "use BF16")
    else:
        reason = (f"largest gradient {g:.3g}{_where(gradients)}{measured}: scales up to 2^{k_max} do not overflow "
                  f"(2^{k_hi} keeps one doubling of "
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
        gradscaler_settles_exponent=(None if forward_overflow
                                     else min(k_max, GRADSCALER_INIT_EXPONENT) if skipped
                                     else GRADSCALER_INIT_EXPONENT),
        viable=viable,
        reason=reason + basis,
        gradients=gradients,
        backward_overflow=backward_overflow,
    )


def _no_gradient_finding(grads: MagnitudeHistogram, forward_overflow: str | None,
                         gradients: Fp16Gradients | None) -> LossScaleFinding:
    """No finite non-zero gradient computed in FP16: any scale works (and none can be derived)."""
    what = ("no non-zero gradient computed in FP16 was measured" if grads.total == grads.zeros == 0 else
            f"every one of the {grads.total:,} gradients computed in FP16 is zero (a batch the model fits "
            "exactly gives this: see the warnings)" if grads.total == grads.zeros else
            "no finite non-zero gradient computed in FP16 was measured")
    return LossScaleFinding(grads.amax, forward_overflow, None, None, None, 0.0, None, 0.0, None, None,
                            forward_overflow is None, what + "; any scale works" + _basis_text(gradients),
                            gradients=gradients)


def _measured_text(b: BackwardOverflow) -> str:
    over = sorted({s for s, n in zip(b.scales, b.nonfinite_param_grads) if n}, reverse=True)
    tried = ", ".join(f"2^{math.floor(math.log2(x))}" for x in over)
    if b.max_exponent is None:
        return (f"the FP16 pass's own backward non-finite with a finite forward at every scale tried ({tried}): "
                "not the loss scale's doing, so it does not lower the scale")
    return (f"the FP16 pass's own backward overflowing at {tried} with a finite forward (a gradient inside a "
            f"module, which no module outputs), finite at 2^{b.max_exponent}")


def _where(gradients: Fp16Gradients | None) -> str:
    return f", {gradients.largest_in}" if gradients and gradients.largest_in else ""


def _basis_text(gradients: Fp16Gradients | None) -> str:
    """What the figures are computed from, for the reason text."""
    if gradients is None:
        return ""
    what = ("gradients computed in FP16 when every module runs in FP16" if gradients.basis == "uniform fp16"
            else "gradients the plan computes in FP16")
    out = f" [{what}"
    if gradients.modules_not_fp16:
        out += f"; {gradients.modules_not_fp16} module(s) outside FP16 do not constrain it"
    if gradients.loss_gradient_excluded is not None:
        out += f"; the loss's own gradient ({gradients.loss_gradient_excluded:g}, FP32) left out"
    return out + "]"


def _edge(k: int) -> float:
    return math.ldexp(SPECS[Format.FP16].overflow_from, -k)
