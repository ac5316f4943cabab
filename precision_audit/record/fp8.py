"""audit.json's ``fp8`` section as typed records (docs/fp8.md; docs/record.md): the FP8 stage's
per-layer measurements of every recipe, the GEMMs outside ``nn.Linear``, the FP8 plan with its cost per recipe,
the target and torchao's auto_filter beside it.

The FP8 stage builds them where it measures and plans: precision_audit/fp8/measure.py ``result_record`` (the
measurements), fp8/other_gemms.py ``other_gemms_record``, fp8/plan.py ``Fp8PlanResult.to_record`` (with
fp8/cost.py ``LayerCost.to_record``), fp8/audit.py ``fp8_stage`` (the plan, target, assumptions, auto_filter).
The attribute names are audit.json's keys, in its order; a figure that is not finite is None (``null`` in the
file, as everywhere in audit.json), the ``nonfinite`` count beside it says why.

Example::

    from precision_audit.record.codec import load_record
    f8 = load_record(Path("audit/audit.json")).fp8
    f8.layers[0].recipes["fp8_rowwise"].meets_budget, f8.plan.modules["head"].recipe
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .section import Section

#: an optional key that an audit writes only when it has a value (left out, not ``null``, otherwise)
_OMIT = {"omit_none": True}


@dataclass
class Fp8Metrics(Section):
    """One comparison against the FP32 GEMM or model (capture/stats.py ``ErrorStats.metrics()``)."""

    rel_l2: float | None
    sqnr_db: float | None  # None also for an exact match
    max_abs: float | None
    cosine: float | None
    nonfinite: int
    elements: int


@dataclass
class Fp8Operand(Section):
    """What quantising one operand of one GEMM did (fp8/linear.py ``OperandStats``): saturated and flushed
    values among the nonzero ones, the scales chosen (None when none was)."""

    saturated_share: float
    flushed_share: float
    saturated: int
    flushed: int
    nonzero: int
    nonfinite: int
    scale_min: float | None
    scale_max: float | None


@dataclass
class Fp8LayerRecipe(Section):
    """One recipe on one linear layer (fp8/measure.py): its local error (the module alone on its FP32 inputs)
    and accumulated error (every linear under the recipe), each GEMM operand's quantisation, the first-order loss
    impact, delayed scaling's stale steps per tensor role, and whether it meets the local budget."""

    local: dict[str, Fp8Metrics | None]  # output / grad_input / grad_weight
    local_per_token_rel_l2: float | None
    local_worst_token_rel_l2: float | None
    accumulated: dict[str, Fp8Metrics | None]  # output / grad_weight
    accumulated_per_token_rel_l2: float | None
    operands: dict[str, Fp8Operand]  # "<gemm>.<operand role>"
    loss_impact: float | None
    stale_steps: dict[str, list[int]] | None  # delayed scaling only
    meets_budget: bool


@dataclass
class Fp8Layer(Section):
    name: str
    in_features: int
    out_features: int
    tokens: int  # rows per call (batch x sequence), summed over calls
    calls: int
    recipes: dict[str, Fp8LayerRecipe]


@dataclass
class Fp8RecipeInfo(Section):
    """A recipe as fp8/recipes.py defines it."""

    description: str
    source: str
    min_compute_capability: list[int]
    torchao_recipe: str | None


@dataclass
class Fp8Budget(Section):
    max_local_rel_error: float
    rule: str


@dataclass
class Fp8OtherGemmRecipe(Section):
    """One recipe on a matmul/bmm outside ``nn.Linear`` (fp8/other_gemms.py): measured (``local``,
    ``operands``, ``meets_budget``) or not, and then only ``note`` says why."""

    local: dict[str, Fp8Metrics | None] | None = field(default=None, metadata=_OMIT)  # output
    operands: dict[str, Fp8Operand] | None = field(default=None, metadata=_OMIT)  # output.a / output.b
    meets_budget: bool | None = field(default=None, metadata=_OMIT)
    note: str | None = field(default=None, metadata=_OMIT)


@dataclass
class Fp8OtherGemm(Section):
    """A matmul/bmm/mm call outside ``nn.Linear``: measured and reported, never planned (``plan`` says why)."""

    module: str  # the innermost module whose forward made the call ("" for the root)
    op: str
    index: int  # the call's position among this module's GEMM calls of this op
    a_shape: list[int]
    b_shape: list[int]
    calls: int
    gemm_flops: int
    recipes: dict[str, Fp8OtherGemmRecipe]
    plan: str


@dataclass
class Fp8RecipeCost(Section):
    """A linear layer's estimated step time under one recipe against BF16 on the target (fp8/cost.py)."""

    bf16_time_s: float | None
    gemm_time_s: float | None
    cast_time_s: float | None
    time_s: float | None
    speedup_vs_bf16: float | None
    convertible: bool
    pays: bool
    note: str | None


@dataclass
class Fp8ModulePlan(Section):
    """The FP8 plan's choice for one linear layer: its recipe (None: it keeps the main plan's format) and why."""

    recipe: str | None
    reason: str
    gemm_flops: int  # per step (three GEMMs) at the costed token count
    cost: dict[str, Fp8RecipeCost]


@dataclass
class Fp8Verified(Section):
    """The chosen FP8 set run together on the model, against the model-level budget."""

    modules: dict[str, str]  # module -> recipe
    loss: float | None
    loss_rel_change: float | None
    output_rel_l2: float | None
    meets_budget: bool


@dataclass
class Fp8PlanReport(Section):
    """The FP8 plan (fp8/plan.py): per linear layer, and for the whole set."""

    modules: dict[str, Fp8ModulePlan]
    fp8_flop_share: float | None
    estimated_linear_speedup_vs_bf16: float | None
    tokens_per_step: dict[str, int]
    verified: Fp8Verified | None  # None when nothing was converted
    dropped_for_budget: list[str]


@dataclass
class Fp8Target(Section):
    name: str
    compute_capability: list[int]
    recipes_supported: list[str]


@dataclass
class Fp8(Section):
    """audit.json's ``fp8``: what each recipe does to each linear layer (and to the GEMMs outside them), and the
    FP8 plan. A model without ``nn.Linear`` has ``plan`` None and ``plan_note`` saying so; a planned one has
    ``target``, ``cost_assumptions`` and ``torchao_auto_filter`` instead."""

    recipes: dict[str, Fp8RecipeInfo]
    budget: Fp8Budget
    loss_fp32: float | None
    loss: dict[str, float | None]  # None: the model failed under the recipe (``errors`` says how)
    output_error: dict[str, Fp8Metrics | None]
    history_steps: int
    layers: list[Fp8Layer]
    notes: list[str]
    errors: dict[str, str]
    other_gemms: list[Fp8OtherGemm]
    plan: Fp8PlanReport | None = None
    plan_note: str | None = field(default=None, metadata=_OMIT)
    target: Fp8Target | None = field(default=None, metadata=_OMIT)
    cost_assumptions: list[str] | None = field(default=None, metadata=_OMIT)
    #: torchao 0.18's verdict per layer and recipe (fp8/cost.py ``torchao_auto_filter``): True converts it
    torchao_auto_filter: dict[str, dict[str, bool | None]] | None = field(default=None, metadata=_OMIT)
