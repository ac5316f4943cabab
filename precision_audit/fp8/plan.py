"""The FP8 plan: per linear module, the fastest FP8 recipe that meets the error budget and pays on the target,
else the module keeps the format of the main plan (docs/fp8.md, "The plan").

A recipe is a candidate for a module when the target has Tensor Cores for it, the runtime can apply it (by
default through torchao: tensorwise, rowwise, rowwise_with_gw_hp), the module's dimensions allow it, its
estimated step time beats BF16 (fp8/cost.py), and its local output error, whole and per token, is within the
budget. The chosen set is then run together on the model (every other linear in FP32) and checked against the
model-level budget (loss change and output error); while that fails, the module whose local error moves the loss
most (first-order impact) goes back to the main plan's format.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import host_rng
from ..capture.stats import ErrorStats
from ..gpus import GpuSpec
from ..model_names import named_modules
from ..record.fp8 import Fp8ModulePlan, Fp8PlanReport, Fp8Verified
from .cost import LayerCost, layer_cost
from .measure import Fp8Result, LayerResult
from .recipes import RECIPES, supported

TORCHAO_RECIPES = ("fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_gw_hp")


@dataclass
class ModuleChoice:
    name: str
    recipe: str | None  # None: the module keeps the main plan's format
    reason: str
    flops: int  # GEMM FLOPs per step (three GEMMs) at the costed token count
    costs: dict[str, LayerCost] = field(default_factory=dict)


@dataclass
class Fp8PlanResult:
    choices: dict[str, ModuleChoice]
    tokens_per_step: dict[str, int]
    verified: Fp8Verified | None = None  # loss and output error of the chosen set run together
    dropped: list[str] = field(default_factory=list)  # modules taken back to meet the model-level budget

    @property
    def modules(self) -> dict[str, str]:
        return {n: c.recipe for n, c in self.choices.items() if c.recipe}

    def fp8_flop_share(self) -> float:
        total = sum(c.flops for c in self.choices.values())
        return sum(c.flops for c in self.choices.values() if c.recipe) / total if total else 0.0

    def estimated_speedup(self) -> float | None:
        """BF16 time of every linear over the time with the plan's FP8 modules (linears only)."""
        bf16 = planned = 0.0
        for c in self.choices.values():
            if not c.costs:
                return None
            base = next(iter(c.costs.values())).bf16_time_s
            bf16 += base
            t = c.costs[c.recipe].time_s if c.recipe else None
            planned += t if t is not None else base
        return bf16 / planned if planned else None

    def to_record(self) -> Fp8PlanReport:
        """audit.json's ``fp8.plan`` (docs/fp8.md, "The plan")."""
        return Fp8PlanReport(
            modules={n: Fp8ModulePlan(recipe=c.recipe, reason=c.reason, gemm_flops=c.flops,
                                      cost={r: lc.to_record() for r, lc in c.costs.items()})
                     for n, c in self.choices.items()},
            fp8_flop_share=self.fp8_flop_share(),
            estimated_linear_speedup_vs_bf16=self.estimated_speedup(),
            tokens_per_step=self.tokens_per_step,
            verified=self.verified,
            dropped_for_budget=self.dropped,
        )


def _local_error(layer: LayerResult, recipe: str) -> float:
    res = layer.recipes.get(recipe)
    if res is None or "output" not in res.local:
        return math.inf
    e = max(res.local["output"].rel_l2, res.local_token.rel_l2)
    return e if math.isfinite(e) else math.inf


def plan_fp8(result: Fp8Result, target: GpuSpec, *, max_local_rel_error: float, max_loss_rel_change: float,
             max_output_rel_error: float, tokens_per_step: int | None = None,
             recipes: tuple[str, ...] = TORCHAO_RECIPES,
             verify: Callable[[dict[str, str]], tuple[float, ErrorStats]] | None = None) -> Fp8PlanResult:
    """Choose a recipe per linear (see the module docstring). ``tokens_per_step``: the rows each linear sees per
    training step for the cost model (default: what the audited batch gave it). ``verify(modules)`` runs the
    model with ``{name: recipe}`` and returns (loss, output ErrorStats); without it the set is not verified."""
    choices: dict[str, ModuleChoice] = {}
    tokens: dict[str, int] = {}
    for L in result.layers:
        t = tokens_per_step or max(1, L.tokens // max(1, L.calls))
        tokens[L.name] = t
        flops = 3 * 2 * t * L.in_features * L.out_features * max(1, L.calls)
        costs = {r: layer_cost(t, L.in_features, L.out_features, r, target) for r in recipes}
        why_not: list[str] = []
        ok: list[tuple[float, float, str]] = []
        for r in recipes:
            c = costs[r]
            err = _local_error(L, r)
            if not supported(RECIPES[r], target.compute_capability):
                why_not.append(f"{r}: {target.name} has no Tensor Cores for it")
            elif r not in L.recipes:
                why_not.append(f"{r}: not measured")
            elif err > max_local_rel_error:
                why_not.append(f"{r}: local error {err:.2e} over the budget {max_local_rel_error:.0e}")
            elif not c.convertible:
                why_not.append(f"{r}: {c.note}")
            elif not c.pays:
                why_not.append(f"{r}: not worth converting (est. {c.speedup:.2f}x vs BF16 at {t} tokens)")
            elif c.time_s is not None:
                ok.append((c.time_s, err, r))
        if ok:
            _, err, r = min(ok)
            reason = (f"{r}: local error {err:.2e} within {max_local_rel_error:.0e}, est. {costs[r].speedup:.2f}x "
                      f"vs BF16 on {target.name} at {t} tokens" + (f" (not {'; '.join(why_not)})" if why_not else ""))
            choices[L.name] = ModuleChoice(L.name, r, reason, flops, costs)
        else:
            choices[L.name] = ModuleChoice(L.name, None, "kept in the plan's format: " + "; ".join(why_not), flops,
                                           costs)
    plan = Fp8PlanResult(choices, tokens)
    if verify is None or not plan.modules:
        return plan
    impact = {L.name: abs(L.recipes[c.recipe].loss_impact) for L in result.layers
              for c in [choices[L.name]] if c.recipe}
    while plan.modules:
        loss, oerr = verify(plan.modules)
        rel_loss = abs(loss - result.loss_fp32) / max(abs(result.loss_fp32), 1e-30)
        within = rel_loss <= max_loss_rel_change and oerr.rel_l2 <= max_output_rel_error
        plan.verified = Fp8Verified(modules=dict(plan.modules), loss=loss, loss_rel_change=rel_loss,
                                    output_rel_l2=oerr.rel_l2, meets_budget=within)
        if within:
            break
        worst = max(plan.modules, key=lambda n: (impact.get(n, 0.0), n))
        ch = choices[worst]
        ch.reason = (f"kept in the plan's format: {ch.recipe} met its local budget, but the FP8 set together broke "
                     f"the model budget (loss change {rel_loss:.2e}, output error {oerr.rel_l2:.2e}) and this module "
                     f"moves the loss most (first-order {impact.get(worst, 0.0):.2e})")
        ch.recipe = None
        plan.dropped.append(worst)
    return plan


def make_verifier(model: torch.nn.Module, forward: Callable[[torch.nn.Module], Any],
                  loss_of: Callable[[Any], torch.Tensor], ref_out: list[torch.Tensor], seed: int = 0,
                  device: str = "cpu") -> Callable[[dict[str, str]], tuple[float, ErrorStats]]:
    """A ``verify`` for :func:`plan_fp8`: one forward of ``model`` with the given linears under their recipes
    (the others in FP32), its loss and output error against ``ref_out``. The model is put back after each run."""
    from ..capture import ModelState
    from ..capture.records import float_tensors
    from .linear import Fp8State, patched

    def verify(modules: dict[str, str]) -> tuple[float, ErrorStats]:
        mods: dict[str, Any] = dict(named_modules(model))
        state = ModelState(model, device)
        state.prepare()
        try:
            torch.manual_seed(seed)
            host_rng.seed(seed)
            with torch.no_grad(), patched({mods[n]: Fp8State(RECIPES[r]) for n, r in modules.items()}):
                out = forward(model)
                loss = float(loss_of(out))
            e = ErrorStats()
            for r, y in zip(ref_out, float_tensors(out)):
                if r.shape == y.shape:
                    e.update(r, y)
            return loss, e
        finally:
            state.restore()
    return verify
