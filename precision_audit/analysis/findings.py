"""Per-layer and per-format findings derived from the capture records.

Everything here is a pure function of :class:`~precision_audit.capture.records.CaptureResult`; nothing runs
the model. Non-finite metric values stay ``inf``/``nan`` in these records and become ``null`` in JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..capture.records import CaptureResult, LayerRecord, RunRecord
from ..capture.stats import ErrorStats, MagnitudeHistogram
from ..formats import RANGE_FORMATS, Format, headroom_bits
from ..options import Budget
from .histograms import Counts
from .loss_scale import LossScaleFinding, backward_overflow, recommend_fp16_loss_scale


@dataclass(frozen=True)
class RangeFinding:
    """Magnitudes of one kind of tensor (outputs, or gradients) and what each format makes of them."""

    amax: float
    elements: int
    zeros: int
    nonfinite: int
    headroom_bits: dict[str, float | None]
    fractions: dict[str, dict[str, float]]  # format -> flushed / subnormal / overflow
    exponent_histogram: dict[int, int]

    @classmethod
    def of(cls, h: MagnitudeHistogram, formats: tuple[Format, ...] = RANGE_FORMATS,
           scale_exponent: int = 0, counts: Counts | None = None) -> RangeFinding:
        """The finding of ``h`` (``counts``: its counts already read, analysis/histograms.py)."""
        c = counts or Counts(h)
        return cls(
            amax=h.amax,
            elements=h.total,
            zeros=h.zeros,
            nonfinite=h.nonfinite,
            headroom_bits={f.value: headroom_bits(f, h.amax) for f in formats},
            fractions={f.value: c.fractions(f, scale_exponent) for f in formats},
            exponent_histogram=c.exponent_histogram(),
        )

    def overflows(self, fmt: Format) -> bool:
        return self.fractions.get(fmt.value, {}).get("overflow", 0.0) > 0


@dataclass(frozen=True)
class GradientFinding:
    """FP16 view of a module's gradients (w.r.t. its outputs, and w.r.t. its own parameters)."""

    output_amax: float
    output_fp16_unscaled: dict[str, float]
    output_fp16_at_recommended: dict[str, float] | None
    param_amax: float | None
    param_fp16_unscaled: dict[str, float] | None
    param_fp16_at_recommended: dict[str, float] | None
    output_exponent_histogram: dict[int, int]
    nonfinite: dict[str, int]  # per format: non-finite elements in the format run's gradients
    fp32_output_nonfinite: int = 0  # non-finite elements of the FP32 reference's dL/dy
    fp32_param_nonfinite: int = 0  # ... and of its own parameters' FP32 gradients


@dataclass
class FormatError:
    local: ErrorStats | None
    local_note: str | None
    accumulated: ErrorStats
    output_dtypes: list[str]
    activation_amax: float
    activation_nonfinite: int
    unmatched_calls: int


@dataclass
class LayerFinding:
    name: str
    type: str
    depth: int
    is_leaf: bool
    computes: bool
    calls: int
    param_count: int
    total_param_count: int
    output_shapes: list[list[int]]
    errors: dict[Format, FormatError]
    activation: RangeFinding
    gradient: GradientFinding
    notes: list[str] = field(default_factory=list)

    def overflows(self, fmt: Format) -> bool:
        """The FP32 outputs of this module do not fit ``fmt``, or its low-precision re-run was not finite."""
        err = self.errors.get(fmt)
        return self.activation.overflows(fmt) or bool(err and err.local and err.local.nonfinite)


@dataclass(frozen=True)
class Fp32NonFinite:
    """Non-finite values the FP32 reference pass itself has (its output and loss are finite, or the audit stops):
    per module, its own outputs, the gradient arriving at them, and its own parameters' gradients.

    Low-precision formats are judged only on what they add: their error metrics leave out the positions where
    FP32 is not finite, and their non-finite parameter-gradient count is of positions finite in FP32.
    """

    modules: list[dict[str, Any]]  # {"name", "type", "outputs", "output_grads", "param_grads"}, forward order
    outputs: int  # non-finite module-output values (each module counted at its own output; nested ones overlap)
    output_grads: int
    param_grads: int  # non-finite parameter-gradient values (each parameter once)

    @property
    def any(self) -> bool:
        return bool(self.modules)

    def describe(self, limit: int = 3) -> str:
        """One sentence for the terminal, the report and the verdicts."""
        def names(key: str) -> str:
            hit = [m for m in self.modules if m[key]]
            shown = ", ".join(f"{m['name'] or '(model)'} ({m[key]:,})" for m in hit[:limit])
            return shown + (f" and {len(hit) - limit} more" if len(hit) > limit else "")

        parts = []
        if self.outputs:
            parts.append(f"{self.outputs:,} non-finite module-output value(s) in {names('outputs')}")
        if self.param_grads:
            parts.append(f"{self.param_grads:,} non-finite parameter-gradient value(s) in {names('param_grads')}")
        if self.output_grads and not self.param_grads:
            parts.append(f"{self.output_grads:,} non-finite output-gradient value(s) in {names('output_grads')}")
        return ("FP32 itself has " + "; ".join(parts) + ": not counted against any low-precision format, each is "
                "judged on what it adds")


def fp32_nonfinite(capture: CaptureResult) -> Fp32NonFinite:
    """What the FP32 reference pass itself left non-finite (its own problems, not low precision's)."""
    modules: list[dict[str, Any]] = []
    for r in sorted(capture.layers, key=lambda r: r.order):
        o, g, p = r.activation.nonfinite, r.grad_output.nonfinite, r.grad_param.nonfinite
        if o or g or p:
            modules.append({"name": r.name, "type": r.type, "outputs": o, "output_grads": g, "param_grads": p})
    return Fp32NonFinite(modules=modules, outputs=sum(m["outputs"] for m in modules),
                         output_grads=sum(m["output_grads"] for m in modules),
                         param_grads=sum(m["param_grads"] for m in modules))


@dataclass(frozen=True)
class FormatSummary:
    format: Format
    loss: float | None
    loss_rel_change: float | None
    output: ErrorStats | None
    output_nonfinite: int
    param_grads_nonfinite: int
    loss_scale: float
    error: str | None
    safe: bool
    verdict: str
    param_grads_nonfinite_shared: int = 0  # non-finite where FP32's gradients are not finite either
    # The same pass at the second reduction order (capture/noise.py): the decision takes the upper end of the two.
    loss_rel_change_range: tuple[float, float] | None = None
    output_rel_error_range: tuple[float, float] | None = None


@dataclass
class Analysis:
    layers: list[LayerFinding]
    summaries: dict[Format, FormatSummary]
    loss_scale: LossScaleFinding | None
    budget: Budget
    reference_loss: float
    fp32_nonfinite: Fp32NonFinite = field(default_factory=lambda: Fp32NonFinite([], 0, 0, 0))
    noise: Any = None  # capture.noise.NoiseFloor, when the second reduction order was measured


def _grad_fracs(h: MagnitudeHistogram, c: Counts, k: int | None) -> dict[str, float] | None:
    if k is None or h.total == 0:
        return None
    return c.fractions(Format.FP16, k)


def analyse(capture: CaptureResult, budget: Budget, noise: Any = None) -> Analysis:
    """Derive findings from a finished capture; ``noise`` (capture.noise.NoiseFloor) holds the second reduction
    order's passes, and a format's verdict then rests on the upper end of the two orders' figures."""
    forward_overflow = None
    acts = [Counts(r.activation) for r in capture.layers]  # each histogram read once (analysis/histograms.py)
    fp16_layers = [r for r, c in zip(capture.layers, acts) if r.name and c.fractions(Format.FP16)["overflow"] > 0]
    if Format.FP16 in capture.formats and fp16_layers:
        forward_overflow = fp16_layers[0].name
    ls = (recommend_fp16_loss_scale(capture.layers, forward_overflow, backward_overflow(capture.runs.get(Format.FP16)))
          if Format.FP16 in capture.formats else None)
    k_rec = ls.recommended_exponent if ls else None

    layers = [_layer(r, capture, k_rec, c) for r, c in zip(capture.layers, acts)]
    ref = capture.reference.loss or 0.0
    fp32_bad = fp32_nonfinite(capture)
    summaries = {f: _summary(capture.runs[f], ref, budget, fp32_bad, noise) for f in capture.formats
                 if f in capture.runs}
    return Analysis(layers=layers, summaries=summaries, loss_scale=ls, budget=budget, reference_loss=ref,
                    fp32_nonfinite=fp32_bad, noise=noise)


def _layer(r: LayerRecord, capture: CaptureResult, k_rec: int | None, act: Counts) -> LayerFinding:
    errors = {}
    for f, fs in r.formats.items():
        errors[f] = FormatError(
            local=fs.local, local_note=fs.local_note, accumulated=fs.accumulated,
            output_dtypes=sorted(fs.output_dtypes), activation_amax=fs.activation.amax,
            activation_nonfinite=fs.activation.nonfinite, unmatched_calls=fs.unmatched_calls,
        )
    has_params = r.grad_param.total > 0
    out, par = Counts(r.grad_output), Counts(r.grad_param) if has_params else None
    grad = GradientFinding(
        output_amax=r.grad_output.amax,
        output_fp16_unscaled=out.fractions(Format.FP16, 0),
        output_fp16_at_recommended=_grad_fracs(r.grad_output, out, k_rec),
        param_amax=r.grad_param.amax if has_params else None,
        param_fp16_unscaled=par.fractions(Format.FP16, 0) if par else None,
        param_fp16_at_recommended=_grad_fracs(r.grad_param, par, k_rec) if par else None,
        output_exponent_histogram=out.exponent_histogram(),
        nonfinite={f.value: fs.grad_output.nonfinite + fs.grad_param_nonfinite for f, fs in r.formats.items()},
        fp32_output_nonfinite=r.grad_output.nonfinite,
        fp32_param_nonfinite=r.grad_param.nonfinite,
    )
    notes = list(r.notes)
    for note in sorted({g.note for g, _ in r.ops.gemms.values() if not g.lowered and g.note}):
        calls = sum(c for g, c in r.ops.gemms.values() if g.note == note)
        notes.append(f"{calls} GEMM call(s): {note}; the step-time estimates price them in FP32")
    for f, e in errors.items():
        if e.unmatched_calls:
            notes.append(f"{e.unmatched_calls} call(s) in the {f} run had no FP32 counterpart (control flow differed)")
    return LayerFinding(
        name=r.name, type=r.type, depth=r.depth, is_leaf=r.is_leaf, computes=r.computes, calls=r.calls,
        param_count=r.param_count, total_param_count=r.total_param_count, output_shapes=r.output_shapes, errors=errors,
        activation=RangeFinding.of(r.activation, counts=act), gradient=grad, notes=notes,
    )


def _pair(main: float, other: float | None) -> tuple[float, float] | None:
    if other is None or not math.isfinite(other) or not math.isfinite(main):
        return None
    return (min(main, other), max(main, other))


def _figure(pair: tuple[float, float] | None, main: float | None) -> str:
    """A measured figure, as the range over the two reduction orders when there are two (symmetric in them)."""
    if pair is None or f"{pair[0]:.2e}" == f"{pair[1]:.2e}":
        return ("not measured" if main is None else f"{main:.2e}") if pair is None else f"{pair[1]:.2e}"
    return f"{pair[0]:.2e}\u2013{pair[1]:.2e} over two reduction orders"


def _summary(run: RunRecord, ref_loss: float, budget: Budget, fp32_bad: Fp32NonFinite | None = None,
             noise: Any = None) -> FormatSummary:
    fmt = run.format
    if run.error:
        return FormatSummary(fmt, None, None, None, 0, 0, run.loss_scale, run.error, False,
                             f"not measured: the model raised under {fmt}"
                             f"{'' if fmt is Format.TF32 else ' autocast'}: {run.error}")
    loss_change = None
    if run.loss is not None and math.isfinite(run.loss):
        loss_change = abs(run.loss - ref_loss) / abs(ref_loss) if ref_loss else abs(run.loss)
    out = run.output
    out_err = out.rel_l2 if out else math.inf
    finite = run.loss is not None and math.isfinite(run.loss) and run.output_nonfinite == 0
    lc_pair = oe_pair = None
    if noise is not None and fmt in noise.runs and loss_change is not None:
        lc_pair = _pair(loss_change, noise.loss_rel_change(fmt))
        oe_pair = _pair(out_err, noise.runs[fmt].output_rel_error)
    lc_hi = lc_pair[1] if lc_pair else loss_change
    oe_hi = oe_pair[1] if oe_pair else out_err
    problems = []
    if not finite:
        problems.append(f"the loss or the output is not finite ({run.output_nonfinite} non-finite output element(s))")
    else:
        if lc_hi is not None and lc_hi > budget.max_loss_rel_change:
            problems.append(f"loss changes by {_figure(lc_pair, loss_change)} > budget {budget.max_loss_rel_change:g}")
        if oe_hi > budget.max_output_rel_error:
            problems.append(f"output error {_figure(oe_pair, out_err)} > budget {budget.max_output_rel_error:g}")
    # Only the non-finite gradients this format adds (positions finite in FP32) count against it: FP32's own
    # are the model's problem, reported once in summary.fp32.nonfinite (docs/report.md, "audit.json at a glance").
    if run.param_grads_nonfinite:
        problems.append(f"{run.param_grads_nonfinite} non-finite parameter gradient element(s) at loss scale "
                        f"{run.loss_scale:g} where FP32's are finite")
    safe = not problems
    verdict = (f"safe as is: loss change {_figure(lc_pair, loss_change)}, output error {_figure(oe_pair, out_err)}"
               if safe else "unsafe as is: " + "; ".join(problems))
    if fp32_bad is not None and fp32_bad.any:
        verdict += " (judged on what it adds: FP32 itself has non-finite values, see the FP32 row)"
    return FormatSummary(fmt, run.loss, loss_change, out, run.output_nonfinite, run.param_grads_nonfinite,
                         run.loss_scale, None, safe, verdict,
                         param_grads_nonfinite_shared=run.param_grads_nonfinite_shared,
                         loss_rel_change_range=lc_pair, output_rel_error_range=oe_pair)


def finite_or_none(x: Any) -> Any:
    """JSON edge helper: inf/nan become None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
