"""The audit's result as one typed record: :class:`AuditRecord`, built stage by stage (docs/record.md).

Every section of audit.json is a dataclass here (the ``fp8`` section's in precision_audit/record/fp8.py, their
common base :class:`Section` in record/section.py), with the attribute names audit.json uses for its keys
(``ModelFacts.class_`` is the one exception: ``class`` in JSON). The record holds data only: it imports no
stage, so the report and ``verify`` can read it without importing capture or analysis. Exactly one module turns
it into audit.json and back: :mod:`precision_audit.record.codec` (``to_json`` / ``from_json``, validated
against precision_audit/record/schemas/audit.schema.json).

What stays a plain mapping is a map by nature (by format name, by module name, an exponent histogram) or a
section another stage writes through its own ``to_dict`` (``hardware``, ``emulation``, the alignment findings of
analysis/alignment.py, the noise floor's per-layer figures).

Example::

    from precision_audit.record.codec import from_json
    record = from_json(json.load(open("audit/audit.json")))
    record.summary.formats["bf16"].loss_rel_change, record.layers[0].plan.format, record.verdict.exit_code

Hand-edited files keep what this version does not know: each record's ``extra`` holds the keys it has no field
for, and ``absent`` the keys the file left out, so a file read and written again is the same file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .fp8 import Fp8  # its parts: precision_audit/record/fp8.py
from .section import Section, _key

# --- run facts (audit.py: load -> hardware & target) -------------------------------------------------------


@dataclass
class Tool(Section):
    name: str
    version: str


@dataclass
class SkippedFormat(Section):
    format: str
    reason: str


@dataclass
class Options(Section):
    """The options the audit ran with (``--out`` and ``--batch`` as the user wrote them)."""

    model: str
    batch: str | None
    out: str | None
    target: str | None
    formats: list[str] | None
    device: str
    emulate: bool
    steps: int
    seed: int
    budget: dict[str, float]
    kernels: str


@dataclass
class ModelFacts(Section):
    class_: str = _key("class")
    source: str | None = None
    parameters: int = 0
    trainable_parameters: int = 0
    fingerprint: str = ""
    modules: int = 0
    training: bool = False
    mode_note: str | None = None
    output_structure: str | None = None


@dataclass
class BatchFacts(Section):
    source: str | None
    tensors: list[dict[str, Any]]


@dataclass
class LossFacts(Section):
    kind: str
    description: str | None


@dataclass
class Traces(Section):
    dir: str
    files: list[str]
    note: str


# --- per-format summaries (analysis/findings.py, timed by the capture) ------------------------------------


@dataclass
class StepTime(Section):
    measured_s: float | None
    measured_on: str | None
    measured_note: str | None
    estimated_s: float | None
    estimated_note: str


@dataclass
class ErrorMetrics(Section):
    """One comparison against FP32 (capture/stats.py's ErrorStats): ``sqnr_db`` None for an exact match or a
    non-finite result, told apart by ``exact`` and ``nonfinite``."""

    rel_l2: float | None
    sqnr_db: float | None
    max_abs: float | None
    cosine: float | None
    nonfinite: int
    elements: int
    exact: bool
    fp32_nonfinite: int


@dataclass
class Fp32NonFiniteFacts(Section):
    outputs: int
    output_grads: int
    param_grads: int
    modules: list[dict[str, Any]]
    note: str | None


@dataclass
class ReferenceSummary(Section):
    loss: float | None
    step_time: StepTime
    nonfinite: Fp32NonFiniteFacts


@dataclass
class FormatNonFinite(Section):
    outputs: int
    param_grads: int
    param_grads_also_in_fp32: int


@dataclass
class FormatSummary(Section):
    loss: float | None
    loss_rel_change: float | None
    output: ErrorMetrics | None
    nonfinite: FormatNonFinite
    loss_scale: float | None
    pass_error: str | None
    safe: bool
    verdict: str
    step_time: StepTime


@dataclass
class Summary(Section):
    """audit.json's ``summary``: the reference under ``fp32`` and one entry per measured format, side by side
    (in JSON one object keyed by format name)."""

    fp32: ReferenceSummary
    formats: dict[str, FormatSummary] = field(default_factory=dict)


# --- estimates and memory (analysis/performance.py) --------------------------------------------------------


@dataclass
class Estimates(Section):
    target: str
    kind: str
    step_time_s: dict[str, float]
    speedup_vs_fp32: dict[str, float | None]
    assumptions: list[str]


@dataclass
class FormatMemory(Section):
    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: dict[str, int]
    saved_activation_bytes: int
    saved_weight_copy_bytes: int
    total_with_adam_bytes: int
    peak_gpu_bytes: int | None
    peak_note: str | None


@dataclass
class Memory(Section):
    per_format: dict[str, FormatMemory]
    advice: list[str]
    note: str
    peak_basis: str | None


# --- alignment (analysis/alignment.py ranks what analysis/performance.py found) ----------------------------


@dataclass
class AlignmentRanking(Section):
    """The model's alignment findings ranked by estimated time lost per step (analysis/alignment.py); each
    finding is kept as that module writes it."""

    format: str | None
    ranked_by: str
    step_time_s: float | None
    threshold: dict[str, float]
    findings: list[dict[str, Any]]
    collapsed: dict[str, Any] | None
    batch_note: dict[str, Any] | None


# --- FP16 loss scale (analysis/loss_scale.py) and the noise floor (capture/noise.py) -----------------------


@dataclass
class LossScale(Section):
    """The FP16 loss scale for the uniform FP16 pass; ``plan`` the one re-derived for the modules the plan runs
    in FP16 (null when that is the same finding, or the plan runs nothing in FP16)."""

    recommended_init_scale: float | None
    recommended_exponent: int | None
    safe_range: list[float] | None
    max_no_overflow_scale: float | None
    max_abs_grad: float | None
    flushed_fraction: dict[str, float | None]
    overflow_fraction: dict[str, float | None]
    forward_overflow: str | None
    expected_skipped_steps: int | None
    every_step_skipped: bool
    gradscaler_default: dict[str, Any]
    viable: bool
    reason: str
    gradients: dict[str, Any] | None
    # the FP16 pass's own backward overflows above the scale it ran at (analysis/loss_scale.py, BackwardOverflow)
    backward_overflow: dict[str, Any] | None = None
    plan: dict[str, Any] | None = None


@dataclass
class RecheckFigure(Section):
    value: float | None  # at the audit's own reduction order
    threshold: float


@dataclass
class Recheck(Section):
    """One decision weighed for the second reduction order (docs/plan.md, "Noise floor")."""

    decision: str
    rechecked: bool
    reason: str
    figures: dict[str, RecheckFigure]


@dataclass
class NoiseFloor(Section):
    method: str
    threads: list[int] | None
    fp32_loss_rel: float | None
    fp32_output_rel_error: float | None
    fp32_layers_rel_l2: dict[str, float | None]
    second_order: dict[str, dict[str, Any]]
    rule: str
    planner_impacts: str | None
    planner_impacts_wall_s: float | None
    # the second order only where it can change a decision (issue 33; planning/second_order.py): the margin, and
    # every decision weighed for it (absent in files written before)
    margins: dict[str, float] | None = None
    rechecks: list[Recheck] | None = None

    def over_budget(self, budget: dict[str, float]) -> list[str]:
        """FP32's own change between the two reduction orders where it exceeds the error budget (``budget``:
        audit.json's ``options.budget``), as phrases ("the loss by 7.15e-01 (budget 1.00e-02)"); [] when within."""
        out = []
        for what, value, key in (("the loss", self.fp32_loss_rel, "max_loss_rel_change"),
                                 ("the output", self.fp32_output_rel_error, "max_output_rel_error")):
            limit = budget.get(key)
            if value is not None and limit is not None and (value > limit or math.isnan(value)):
                out.append(f"{what} by {value:.2e} (budget {limit:.2e})")
        return out


# --- per-layer findings (analysis/findings.py + performance.py + the plan) ---------------------------------


@dataclass
class LayerError(Section):
    local: ErrorMetrics | None
    local_note: str | None
    accumulated: ErrorMetrics | None


@dataclass
class FormatActivation(Section):
    amax: float | None
    nonfinite: int
    dtypes: list[str]


@dataclass
class Activation(Section):
    amax: float | None
    elements: int
    zeros: int
    nonfinite: int
    headroom_bits: dict[str, float | None]
    fractions: dict[str, dict[str, float]]
    exponent_histogram: dict[str, int]
    by_format: dict[str, FormatActivation]


@dataclass
class Fp16GradientFractions(Section):
    unscaled: dict[str, float] | None
    at_recommended: dict[str, float] | None


@dataclass
class OutputGradient(Section):
    amax: float | None
    fp16: Fp16GradientFractions
    exponent_histogram: dict[str, int]


@dataclass
class ParameterGradient(Section):
    amax: float | None
    fp16: Fp16GradientFractions


@dataclass
class Gradient(Section):
    output: OutputGradient
    parameters: ParameterGradient | None
    nonfinite: dict[str, int]
    fp32_nonfinite: dict[str, int]


@dataclass
class LayerCost(Section):
    """A module's own computation and its estimated time per format on the target (analysis/performance.py),
    with what the capture measured beside it."""

    flops: int
    gemm_ops: int
    other_ops: int
    other_elements: int
    estimated_step_time_s: dict[str, float]
    estimated_note: str
    measured_forward_time_s: dict[str, float] | None
    measured_on: str | None
    saved_activation_bytes: dict[str, int] | None
    #: The largest distinct GEMMs timed on the GPU (analysis/gemm_timing.py; cuda mode only).
    measured_gemms: list[dict[str, Any]] | None = field(default=None, metadata={"omit_none": True})


@dataclass
class ModulePlan(Section):
    format: str
    reason: str


@dataclass
class LayerReport(Section):
    """One module that ran, keyed by its ``named_modules()`` name ("" is the model itself)."""

    name: str
    type: str
    depth: int
    is_leaf: bool
    computes: bool
    calls: int
    own_parameters: int
    parameters: int
    output_shapes: list[Any]
    error: dict[str, LayerError]
    activation: Activation
    gradient: Gradient
    alignment: list[dict[str, Any]] | None
    alignment_note: str | None
    cost: LayerCost | None
    cost_note: str | None
    plan: ModulePlan
    notes: list[str]


# --- the plan and its verification (planning/) -------------------------------------------------------------


@dataclass
class PlanCandidateReport(Section):
    label: str
    chosen: bool
    default_format: str
    overrides: int
    loss_scaling: bool
    estimated_step_time_s: float | None
    loss_rel_change: float | None
    loss_rel_change_range: list[float] | None
    output_rel_error: float | None
    within_budget: bool | None
    verification_passes: int
    repairs: list[str]
    note: str
    error: str | None


@dataclass
class PlanVerification(Section):
    passes: int
    loss: float | None
    loss_rel_change: float | None
    loss_rel_change_range: list[float] | None
    output_rel_error: float | None
    within_budget: bool | None
    repairs: list[str]
    error: str | None
    source: str


@dataclass
class PlanReport(Section):
    source: str
    chosen: str
    candidates: list[PlanCandidateReport]
    predicted_loss_change: float | None
    predicted_loss_rel_change: float | None
    first_order_loss_rel_change: float | None
    prediction: dict[str, Any]
    calibration: dict[str, dict[str, Any]]
    loss_budget: float
    promotions: list[str]
    estimated_step_time_s: float | None
    verification: PlanVerification
    default_format: str
    default_reason: str
    overrides: dict[str, ModulePlan]
    override_counts: str


@dataclass
class Verdict(Section):
    exit_code: int
    safe_formats: list[str]
    message: str


# --- precision-audit verify (verify.py): the A/B short training --------------------------------------------


@dataclass
class VerifyResult(Section):
    """``verify``: the same steps from the same weights under FP32, the policy, plain BF16 and FP16."""

    steps: int
    optimizer: str
    lr: float
    seed: int
    mode: str
    curves: dict[str, list[float | None]]
    skipped_steps: dict[str, int]
    errors: dict[str, str]
    final_loss_rel_change: dict[str, float | None]
    param_rel_change: dict[str, float | None]
    policy_failure: str | None
    policy_safe: bool
    loss: LossFacts | None = None


# --- a distributed audit (precision_audit/distributed/run.py, docs/distributed.md) ---------------------------


@dataclass
class RankMemory(Section):
    """One rank's parameter bytes and resident memory (``/proc`` figures; zeros where there is none)."""

    rank: int
    parameter_bytes_held: int
    rss_start_bytes: int
    rss_peak_after_init_bytes: int
    rss_peak_bytes: int


@dataclass
class DistributedMemory(Section):
    """``distributed.memory``: the model's parameter bytes (global shapes) and every rank's memory."""

    model_parameter_bytes: int
    materialised: str
    ranks: list[RankMemory]
    note: str


@dataclass
class Distributed(Section):
    """How a distributed audit ran: ranks, backend, parallelism, the batch split, memory per rank."""

    world_size: int
    backend: str
    parallelism: str
    batch: str
    #: None when ``sample_batch(rank, world_size)`` in the model file gave each rank its share
    global_batch_size: int | None
    rank0_batch_size: int
    reduced: str
    memory: DistributedMemory | None = field(default=None, metadata={"omit_none": True})


# --- the whole record ---------------------------------------------------------------------------------------


@dataclass
class AuditRecord(Section):
    """Everything audit.json holds, in its order (docs/record.md says which stage fills which field)."""

    schema: str
    version: int
    tool: Tool
    created: str
    mode: str
    device: str
    hardware: dict[str, Any]
    target: dict[str, Any]
    formats: list[str]
    formats_skipped: list[SkippedFormat]
    options: Options
    model: ModelFacts
    batch: BatchFacts
    loss: LossFacts
    emulation: dict[str, Any] | None
    summary: Summary
    estimates: Estimates | None
    memory: Memory | None
    traces: Traces | None
    alignment: AlignmentRanking | None
    loss_scale: LossScale | None
    layers: list[LayerReport]
    noise_floor: NoiseFloor | None
    plan: PlanReport
    verdict: Verdict
    warnings: list[str]
    #: FP8 recipes per linear layer, when an FP8 format was asked for (precision_audit/fp8/audit.py, docs/fp8.md).
    fp8: Fp8 | None = field(default=None, metadata={"omit_none": True})
    #: How a distributed audit ran: ranks, parallelism, the batch split, memory per rank
    #: (precision_audit/distributed/run.py, docs/distributed.md); absent in a single-process audit.
    distributed: Distributed | None = field(default=None, metadata={"omit_none": True})
    #: Added by ``precision-audit verify`` (absent until a policy is verified).
    verify: VerifyResult | None = field(default=None, metadata={"omit_none": True})

    def estimated_speedup(self, fmt: str) -> float | None:
        """Estimated speedup of the all-``fmt`` step over FP32 on the target: ``estimates.speedup_vs_fp32``, or
        the ratio of the two ``summary`` step-time estimates (a hand-edited file may have only those)."""
        est = self.estimates
        sp = (est.speedup_vs_fp32 or {}).get(fmt) if isinstance(est, Estimates) else None
        if isinstance(sp, (int, float)) and not isinstance(sp, bool):
            return float(sp)

        def estimated(s: ReferenceSummary | FormatSummary | None) -> float | None:
            return s.step_time.estimated_s if s is not None and isinstance(s.step_time, StepTime) else None

        ref = estimated(self.summary.fp32)
        mine = ref if fmt == "fp32" else estimated(self.summary.formats.get(fmt))
        if not (ref and mine):
            return None
        ratio = ref / mine
        return ratio if math.isfinite(ratio) else None  # 1e308 / 5e-324 overflows: no speedup to show

    def layer(self, name: str) -> LayerReport | None:
        """The layer of that ``named_modules()`` name, or None."""
        return next((L for L in self.layers if L.name == name), None)
