"""The audit record's sections from each stage's results (precision_audit/record/__init__.py; docs/record.md).

audit.py calls these in the order the stages run: the run facts once the model, target and device are known;
the per-format summaries and the per-layer entries once the analysis, the cost model and the plan are done; the
plan's section after its verification. Nothing here measures or decides anything: it puts figures the stages
computed into the record, and words them where audit.json carries a note.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import record as R
from .analysis.findings import Analysis, FormatError, LayerFinding, RangeFinding
from .analysis.performance import LayerPerformance, Performance
from .capture.records import CaptureResult
from .capture.stats import ErrorStats
from .formats import LOW_PRECISION_DTYPES, Format
from .model_names import named_modules
from .planning.rules import Plan
from .planning.select import PlanCandidate
from .planning.verified import ChosenPlan


def error_metrics(e: ErrorStats | None) -> R.ErrorMetrics | None:
    if e is None:
        return None
    # sqnr_db is null both for an exact match (infinite SQNR: "exact" is true) and for a non-finite result
    # ("nonfinite" > 0); JSON has no infinity.
    return R.ErrorMetrics(rel_l2=e.rel_l2, sqnr_db=e.sqnr_db, max_abs=e.max_abs if not e.nonfinite else math.inf,
                          cosine=e.cosine, nonfinite=e.nonfinite, elements=e.n,
                          exact=e.nonfinite == 0 and e.sum_diff2 == 0, fp32_nonfinite=e.ref_nonfinite)


def _histogram(h: dict[int, int]) -> dict[str, int]:
    return {str(k): v for k, v in sorted(h.items())}


def _activation(L: LayerFinding) -> R.Activation:
    r: RangeFinding = L.activation
    return R.Activation(
        amax=r.amax, elements=r.elements, zeros=r.zeros, nonfinite=r.nonfinite, headroom_bits=dict(r.headroom_bits),
        fractions={k: dict(v) for k, v in r.fractions.items()}, exponent_histogram=_histogram(r.exponent_histogram),
        by_format={f.value: R.FormatActivation(amax=e.activation_amax, nonfinite=e.activation_nonfinite,
                                               dtypes=list(e.output_dtypes)) for f, e in L.errors.items()})


def _gradient(L: LayerFinding) -> R.Gradient:
    g = L.gradient
    return R.Gradient(
        output=R.OutputGradient(amax=g.output_amax,
                                fp16=R.Fp16GradientFractions(unscaled=g.output_fp16_unscaled,
                                                             at_recommended=g.output_fp16_at_recommended),
                                exponent_histogram=_histogram(g.output_exponent_histogram)),
        parameters=None if g.param_amax is None else R.ParameterGradient(
            amax=g.param_amax, fp16=R.Fp16GradientFractions(unscaled=g.param_fp16_unscaled,
                                                            at_recommended=g.param_fp16_at_recommended)),
        nonfinite=dict(g.nonfinite),
        fp32_nonfinite={"output": g.fp32_output_nonfinite, "parameters": g.fp32_param_nonfinite})


def _layer_error(e: FormatError) -> R.LayerError:
    return R.LayerError(local=error_metrics(e.local), local_note=e.local_note, accumulated=error_metrics(e.accumulated))


def _layer_cost(perf: LayerPerformance | None, time_label: str) -> R.LayerCost | None:
    if perf is None or perf.cost is None:
        return None
    c = perf.cost
    return R.LayerCost(flops=c.flops, gemm_ops=c.gemm_ops, other_ops=c.other_ops, other_elements=c.other_elements,
                       estimated_step_time_s=dict(c.estimated_step_time_s),
                       estimated_note="estimate for the target GPU (roofline; see estimates.assumptions)",
                       measured_forward_time_s=perf.measured_time_s or None,
                       measured_on=time_label if perf.measured_time_s else None,
                       saved_activation_bytes=perf.saved_bytes or None,
                       measured_gemms=list(c.measured_gemms) or None)


def layer_report(L: LayerFinding, plan: Plan, perf: LayerPerformance | None, time_label: str) -> R.LayerReport:
    """One module's entry: the analysis' finding, its alignment and cost, and the plan's format for it."""
    lp = plan.layers[L.name]
    return R.LayerReport(
        name=L.name, type=L.type, depth=L.depth, is_leaf=L.is_leaf, computes=L.computes, calls=L.calls,
        own_parameters=L.param_count, parameters=L.total_param_count, output_shapes=L.output_shapes,
        error={f.value: _layer_error(e) for f, e in L.errors.items()},
        activation=_activation(L), gradient=_gradient(L),
        alignment=perf.alignment if perf else None,
        alignment_note=(None if perf and perf.alignment else
                        "no GEMM, convolution or attention of its own" if perf else "not measured"),
        cost=_layer_cost(perf, time_label),
        cost_note=None if perf and perf.cost else "no computation of its own",
        plan=R.ModulePlan(format=lp.format.value, reason=lp.reason),
        notes=L.notes)


def summary(analysis: Analysis, step_times: dict[str, list[float]], time_label: str,
            estimates: dict[str, float], target_name: str) -> R.Summary:
    """The FP32 reference and each measured format: loss, output error, non-finite counts, step times."""
    def times(key: str) -> R.StepTime:
        t = step_times.get(key)
        est = estimates.get(key)
        return R.StepTime(
            measured_s=min(t) if t else None, measured_on=time_label if t else None,
            measured_note=None if t else "not measured: the pass failed or --steps 0", estimated_s=est,
            estimated_note=(f"estimate for {target_name}: roofline over the shapes seen (see estimates)"
                            if est is not None else f"not estimated: {target_name} has no peak for this format"))

    bad = analysis.fp32_nonfinite
    # FP32's own non-finite values (its loss and output are finite, or the audit stops): the model's problem,
    # not counted against any format (docs/report.md, "audit.json at a glance")
    reference = R.ReferenceSummary(
        loss=analysis.reference_loss, step_time=times("fp32"),
        nonfinite=R.Fp32NonFiniteFacts(outputs=bad.outputs, output_grads=bad.output_grads,
                                       param_grads=bad.param_grads, modules=bad.modules,
                                       note=bad.describe() if bad.any else None))
    return R.Summary(fp32=reference, formats={f.value: R.FormatSummary(
        loss=s.loss, loss_rel_change=s.loss_rel_change, output=error_metrics(s.output),
        nonfinite=R.FormatNonFinite(outputs=s.output_nonfinite, param_grads=s.param_grads_nonfinite,
                                    param_grads_also_in_fp32=s.param_grads_nonfinite_shared),
        loss_scale=s.loss_scale, pass_error=s.error, safe=s.safe, verdict=s.verdict, step_time=times(f.value))
        for f, s in analysis.summaries.items()})


def estimates(perf: Performance, target_name: str) -> R.Estimates:
    return R.Estimates(target=target_name, kind="estimate", step_time_s=dict(perf.step_time_s),
                       speedup_vs_fp32=dict(perf.speedup_vs_fp32), assumptions=list(perf.assumptions))


def plan_counts(plan: Plan) -> str:
    """The plan's overrides counted by format, from the plan itself: "5 in fp32, 7 in bf16" ("" when none)."""
    by: dict[str, int] = {}
    for o in plan.overrides.values():
        by[o.format.value] = by.get(o.format.value, 0) + 1
    return ", ".join(f"{n} in {f}" for f, n in sorted(by.items(), key=lambda x: (-x[1], x[0])))


def _candidate(c: PlanCandidate, chosen: bool) -> R.PlanCandidateReport:
    return R.PlanCandidateReport(
        label=c.label, chosen=chosen, default_format=c.plan.default_format.value, overrides=len(c.plan.overrides),
        loss_scaling=c.loss_scaling, estimated_step_time_s=c.estimated_step_time_s,
        loss_rel_change=c.loss_rel_change,
        loss_rel_change_range=list(c.loss_rel_change_range) if c.loss_rel_change_range else None,
        output_rel_error=c.output_rel_error, within_budget=c.within_budget, verification_passes=c.passes,
        repairs=list(c.repairs), note=c.note, error=c.error)


def plan_report(chosen: ChosenPlan, analysis: Analysis) -> R.PlanReport:
    """The plan as audit.json's ``plan``: the candidates weighed, the prediction against the verification."""
    from .planning.select import first_order_rel, predicted_rel, prediction_note

    plan, best, result = chosen.plan, chosen.chosen, chosen.planner_result
    ref = analysis.reference_loss
    mixed = plan.default_format is not Format.FP32 or bool(plan.overrides)
    predicted = predicted_rel(plan, result, ref) if mixed else 0.0
    first_order = first_order_rel(plan, result, ref) if plan.default_format is not Format.FP32 or plan.overrides \
        else 0.0
    verified = best.loss_rel_change
    floor = analysis.noise.loss_rel if analysis.noise is not None and math.isfinite(analysis.noise.loss_rel) else 0.0
    uniform = best.label.startswith("uniform")
    both = analysis.noise is not None and plan.default_format in analysis.noise.runs  # measured at both orders
    return R.PlanReport(
        source=plan.source, chosen=best.label,
        candidates=[_candidate(c, c is best) for c in chosen.candidates],
        predicted_loss_change=predicted * abs(ref) if predicted is not None else None,
        predicted_loss_rel_change=predicted, first_order_loss_rel_change=first_order,
        prediction=prediction_note(predicted, verified, floor),
        calibration=result.calibration_info if result else {},
        loss_budget=analysis.budget.max_loss_rel_change * abs(ref) if ref else analysis.budget.max_loss_rel_change,
        promotions=result.promotions if result and not uniform else [],
        estimated_step_time_s=best.estimated_step_time_s,
        verification=R.PlanVerification(
            passes=best.passes, loss=best.loss, loss_rel_change=verified,
            loss_rel_change_range=list(best.loss_rel_change_range) if best.loss_rel_change_range else None,
            output_rel_error=best.output_rel_error, within_budget=best.within_budget, repairs=list(best.repairs),
            error=best.error,
            source=(f"the audit's own all-{plan.default_format} pass{'es' if both else ''} (no extra "
                    "pass: this plan is that format, uniform)" if uniform else
                    "forward passes with the policy applied, at the audit's reduction order and, where its figures "
                    "lie near the budget, at the second (noise_floor.rechecks)")),
        default_format=plan.default_format.value, default_reason=plan.default_reason,
        overrides={k: R.ModulePlan(format=v.format.value, reason=v.reason) for k, v in plan.overrides.items()},
        override_counts=plan_counts(plan) or "none")


def verdict(analysis: Analysis, plan: Plan, formats: tuple[Format, ...]) -> R.Verdict:
    """Exit code 0 when some audited format is safe as is (or none was audited), else 1; and its sentence."""
    safe = [f.value for f, s in analysis.summaries.items() if s.safe]
    exit_code = 0 if (safe or not formats) else 1
    return R.Verdict(exit_code=exit_code, safe_formats=safe, message=_verdict_message(plan, safe, formats))


def _verdict_message(plan: Plan, safe: list[str], formats: tuple[Format, ...]) -> str:
    if not formats:
        return "no low-precision format was audited"
    counts = plan_counts(plan)
    pins = (f"; {len(plan.overrides)} module(s) overridden: {counts}" if plan.overrides else
            "; no overrides")
    if safe:
        return f"recommended: {plan.default_format} by default{pins}. Safe as is: {', '.join(safe)}"
    return (f"unsafe in every audited format as is ({', '.join(f.value for f in formats)}); "
            f"the policy runs {plan.default_format} by default{pins}")


def section(cls: type, content: dict[str, Any] | None) -> Any:
    """A section another stage writes through its own ``to_dict`` (the loss scale, the noise floor, the
    alignment ranking), typed as the record's ``cls``."""
    from .record.codec import read

    return None if content is None else read(cls, content)


def options(opts: Any, steps: int) -> R.Options:
    """The options as audit.json records them (``opts``: the :class:`~precision_audit.options.AuditOptions`)."""
    return R.Options(model=opts.model, batch=opts.batch, out=str(opts.out), target=opts.target,
                     formats=[f.value for f in opts.formats] if opts.formats else None, device=opts.device,
                     emulate=opts.emulate, steps=steps, seed=opts.seed, budget=opts.budget.to_dict(),
                     kernels=opts.kernels)


def model_facts(model: torch.nn.Module, source_label: str, fp: str, n_modules: int, training: bool,
                structures: list[str]) -> R.ModelFacts:
    return R.ModelFacts(
        class_=type(model).__name__, source=source_label, parameters=sum(p.numel() for p in model.parameters()),
        trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad), fingerprint=fp,
        modules=n_modules, training=training,
        mode_note=("audited in train mode (as the model was given): dropout is active with the same masks "
                   "in every format, BatchNorm uses batch statistics" if training else
                   "audited in eval mode (as the model was given): dropout off, BatchNorm uses running statistics"),
        output_structure=structures[0] if structures else None)


def rnn_warning(model: torch.nn.Module, mode: str) -> list[str]:
    rnns = [n for n, m in named_modules(model) if isinstance(m, (torch.nn.LSTM, torch.nn.GRU))]
    if mode != "emulated" or not rnns:
        return []
    return [f"{', '.join(rnns[:5])}: nn.LSTM/nn.GRU run in fp16 on CUDA through cuDNN's own autocast wrapper, "
            "which the emulation does not reproduce (they stay fp32 here); audit on a GPU for their numerics"]


def frozen_low_precision_warning(model: torch.nn.Module) -> list[str]:
    """Frozen fp16/bf16 parameters beside float32 trained ones (a bf16 base under float32 LoRA adapters): the
    model as it trains, and accepted (loading/model.py), but then the FP32 reference computes with those weights
    as stored, so it is not an all-FP32 pass, and what the formats' figures measure is what autocast adds."""
    low = [(n, p) for n, p in model.named_parameters()
           if not p.requires_grad and p.dtype in LOW_PRECISION_DTYPES.values()]
    if not low:
        return []
    total = sum(p.numel() for p in model.parameters()) or 1
    share = sum(p.numel() for _, p in low) / total
    dtypes = "/".join(sorted({str(p.dtype).replace("torch.", "") for _, p in low}))
    shown = ", ".join(n for n, _ in low[:3]) + (f" and {len(low) - 3} more" if len(low) > 3 else "")
    return [f"{len(low)} frozen parameter tensors ({100 * share:.0f}% of the model's values: {shown}) are stored "
            f"in {dtypes}: the FP32 reference computes with them as stored, as training does, so it is not an "
            f"all-FP32 pass; every format's figures measure what autocast adds on top of those {dtypes} weights, "
            "not their own rounding (build the model in float32 to measure that as well)"]


def unlowered_warning(capture: CaptureResult) -> list[str]:
    """GEMMs CUDA autocast does not lower (torch._grouped_mm, the experts of a mixture of experts): under fp16/bf16
    autocast they run in FP32, which the per-layer notes say and the step-time estimates price."""
    names = [r.name or "(model)" for r in capture.layers if any(not g.lowered for g, _ in r.ops.gemms.values())]
    if not names:
        return []
    ops = sorted({g.op for r in capture.layers for g, _ in r.ops.gemms.values() if not g.lowered})
    flops = sum(g.flops * c for r in capture.layers for g, c in r.ops.gemms.values() if not g.lowered)
    total = sum(g.flops * c for r in capture.layers for g, c in r.ops.gemms.values()) or 1
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return [f"{100 * flops / total:.0f}% of the model's GEMM FLOPs ({', '.join(ops)} in {shown}) are in no CUDA "
            "autocast list: under fp16/bf16 autocast they run at their inputs' dtype (FP32 here) with no Tensor "
            "Core speed-up, which the step-time estimates price; casting their inputs and weights to bf16 in the "
            "model is what would run them in low precision"]


def noise_warning(noise: R.NoiseFloor | None, budget: dict[str, float]) -> list[str]:
    """FP32 itself not reproducible within the budget: at the second reduction order (docs/plan.md, "Noise floor")
    the FP32 loss or output moves by more than any format is allowed to. Every figure is then within FP32's own
    noise, and the plan's verification agrees only because it runs at the same orders as the reference."""
    over = noise.over_budget(budget) if noise is not None else []
    if not over:
        return []
    assert noise is not None
    limit = budget.get("max_output_rel_error", math.inf)
    first = next((name or "(the model)" for name, v in noise.fp32_layers_rel_l2.items()
                  if v is not None and (v > limit or math.isnan(v))), None)
    where = f"; of the layers sampled, the first to move beyond the output budget is {first}" if first else ""
    return [f"FP32 is not reproducible on this model and batch: at a second reduction order ({noise.method}) FP32 "
            f"itself changes {' and '.join(over)}{where}. Every format's figures and the plan's verification are "
            "within FP32's own noise here, so they cannot tell low precision apart from the order of summation, "
            "and a plan that passes at these two orders need not pass on the GPU. Usually the sample batch is "
            "degenerate for the model (BatchNorm over a few samples or positions, inputs unlike the training data) "
            "or the model is unstable at its initialisation: audit a batch of training size, or a trained "
            "checkpoint; or the budget (--budget) is tighter than FP32 itself reproduces"]


def zero_gradient_warning(capture: CaptureResult) -> list[str]:
    """Every gradient of the FP32 backward is zero (module outputs and parameters; the loss's own dL/dL apart):
    the model fits the batch exactly, e.g. a random-init Funnel Transformer whose tied-embedding logits reach
    hundreds on its own input tokens (cross-entropy 0.0). Then nothing about gradients was measured."""
    total = nonzero = 0
    for r in capture.layers:
        for h in (*r.grad_output_own.values(), r.grad_param, r.grad_param_tied):
            total += h.total
            nonzero += h.total - h.zeros
    if total == 0 or nonzero:
        return []
    return [f"every gradient of the FP32 backward is zero ({total:,} values; loss {capture.reference.loss:g}): the "
            "model fits this batch exactly (a saturated softmax gives a cross-entropy of 0), so the gradient figures, "
            "the FP16 loss scale and the loss impacts the planner ranks modules by carry no information, and the "
            "plan rests on the loss and output changes alone. Audit a batch the model does not fit yet (real "
            "inputs and labels), or define loss_fn(output, batch) in the model file"]


def run_warnings(capture: CaptureResult, spec: Any, structures: list[str], mode: str) -> list[str]:
    """What the reader must know about how the numbers were obtained: emulation gaps, an inferred or surrogate
    loss (``spec``: the resolved LossSpec), changing output structures, passes that failed."""
    assert spec is not None  # resolved by the reference pass
    w = []
    if mode == "emulated":
        gaps = capture.emulation["known_gaps"] if capture.emulation else []
        w.append("emulated mode: CUDA autocast's op policies and Tensor Core rounding are computed on "
                 f"{capture.device}; known gaps: " + "; ".join(gaps))
        if capture.emulation and capture.emulation["unknown_cuda_autocast_ops"]:
            w.append("ops CUDA autocast lowers that the emulation table lacks (emulated as unlisted): "
                     + ", ".join(capture.emulation["unknown_cuda_autocast_ops"]))
    if str(spec.kind) in ("cross_entropy", "mse"):
        w.append(f"loss inferred: {spec.description}")
    elif str(spec.kind) == "surrogate":
        w.append(f"no loss defined: {spec.description}; gradient figures describe this surrogate, "
                 "define loss_fn(output, batch) in the model file for real ones")
    if len(set(structures)) > 1:
        w.append("the model's forward returned different output structures on different calls: "
                 + " vs ".join(sorted(set(structures))))
    for f, format_run in capture.runs.items():
        if format_run.error:
            w.append(f"{f} pass not measured: {format_run.error}")
    return w
