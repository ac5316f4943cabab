"""The report's FP8 section, from the record's ``fp8`` section (precision_audit/record/fp8.py, docs/fp8.md): per
layer and recipe the local error and whether it meets the budget, saturation and flush shares, estimated speedup,
and the plan's choice; the planned FP8 share of GEMM FLOPs with its estimated speedup; torchao's auto_filter
verdict beside ours."""

from __future__ import annotations

import logging
import math
from typing import Any

from ..record.fp8 import (
    Fp8,
    Fp8Budget,
    Fp8Layer,
    Fp8LayerRecipe,
    Fp8Metrics,
    Fp8ModulePlan,
    Fp8Operand,
    Fp8OtherGemm,
    Fp8OtherGemmRecipe,
    Fp8PlanReport,
    Fp8RecipeCost,
    Fp8Target,
)

log = logging.getLogger(__name__)


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _map(x: Any) -> dict[str, Any]:
    """A map of a hand-edited file that holds something else there: empty."""
    return x if isinstance(x, dict) else {}


def _cell(rec: Fp8LayerRecipe | Fp8OtherGemmRecipe, cost: Any) -> dict[str, Any]:
    if not isinstance(rec, (Fp8LayerRecipe, Fp8OtherGemmRecipe)):
        raise TypeError(f"a recipe's figures are {type(rec).__name__}")
    local = (rec.local or {}).get("output")
    errs = [e for e in (_num(local.rel_l2) if isinstance(local, Fp8Metrics) else None,
                        _num(rec.local_per_token_rel_l2) if isinstance(rec, Fp8LayerRecipe) else None)
            if e is not None]
    ops = [o for o in _map(rec.operands).values() if isinstance(o, Fp8Operand)]
    sat = max((_num(o.saturated_share) or 0.0 for o in ops), default=0.0)
    flush = max((_num(o.flushed_share) or 0.0 for o in ops), default=0.0)
    stale = (rec.stale_steps if isinstance(rec, Fp8LayerRecipe) else None) or {}
    stale_n = sum(len(v) for v in stale.values() if isinstance(v, list)) if isinstance(stale, dict) else 0
    return {"error": max(errs) if errs else None, "ok": bool(rec.meets_budget), "saturated": sat,
            "flushed": flush, "stale": stale_n if stale else None,
            "speedup": _num(cost.speedup_vs_bf16) if isinstance(cost, Fp8RecipeCost) else None}


def _tokens(t: Any) -> str | None:
    """The rows per step the plan was priced at: one number when every layer had the same."""
    if not isinstance(t, dict) or not t:
        return None
    vals = sorted({v for v in t.values() if isinstance(v, int)})
    return None if not vals else str(vals[0]) if len(vals) == 1 else f"{vals[0]}-{vals[-1]}"


def _other_gemms(other: Any, recipes: list[str]) -> list[dict[str, Any]]:
    """Rows for matmul/bmm outside nn.Linear (audit.json ``fp8.other_gemms``)."""
    rows = []
    for o in other if isinstance(other, list) else []:
        if not isinstance(o, Fp8OtherGemm):
            raise TypeError(f"an other_gemms entry is {type(o).__name__}")
        per = _map(o.recipes)
        cells = {r: _cell(per[r], None) for r in recipes
                 if isinstance(per.get(r), Fp8OtherGemmRecipe) and per[r].local is not None}
        rows.append({"name": f"{o.module or '(root)'} {o.op} #{o.index}",
                     "shape": " @ ".join("x".join(map(str, s or [])) for s in (o.a_shape, o.b_shape)),
                     "cells": cells, "reason": "" if o.plan is None else str(o.plan)})
    return rows


def _row(L: Fp8Layer, recipes: list[str], pmods: dict[str, Any], auto: dict[str, Any]) -> dict[str, Any]:
    """One linear layer's row: its cells per recipe, the plan's choice, torchao's verdict."""
    if not isinstance(L, Fp8Layer):
        raise TypeError(f"a layer is {type(L).__name__}")
    name = str(L.name)
    pm = pmods.get(name)
    pm = pm if isinstance(pm, Fp8ModulePlan) else None
    cost = _map(pm.cost) if pm is not None else {}
    per = L.recipes if L.recipes is not None else {}
    cells = {r: _cell(per[r], cost.get(r)) for r in recipes if r in per}
    af = _map(auto.get(name))
    return {"name": name, "shape": f"{L.in_features}→{L.out_features}", "tokens": L.tokens, "cells": cells,
            "recipe": pm.recipe if pm is not None else None,
            "reason": "" if pm is None or pm.reason is None else str(pm.reason),
            "auto_filter": ", ".join(f"{k.removeprefix('fp8_')}: {'convert' if v else 'skip'}"
                                     for k, v in af.items() if v is not None)}


def fp8_view(f: Fp8 | None) -> dict[str, Any] | None:
    """The template's view of the record's ``fp8`` section; None when absent or not as the tool writes it."""
    if not isinstance(f, Fp8):
        return None
    try:
        recipes = [r for r in (f.recipes or {}) if isinstance(r, str)]
        plan = f.plan if isinstance(f.plan, Fp8PlanReport) else None
        pmods = _map(plan.modules) if plan is not None else {}
        rows = [_row(L, recipes, pmods, _map(f.torchao_auto_filter)) for L in f.layers or []]
        return {"recipes": recipes, "rows": rows,
                "budget": _num(f.budget.max_local_rel_error) if isinstance(f.budget, Fp8Budget) else None,
                "share": _num(plan.fp8_flop_share) if plan is not None else None,
                "speedup": _num(plan.estimated_linear_speedup_vs_bf16) if plan is not None else None,
                "target": f.target.name if isinstance(f.target, Fp8Target) else None,
                "notes": [str(n) for n in f.notes or []], "plan_note": f.plan_note,
                "tokens_per_step": _tokens(plan.tokens_per_step) if plan is not None else None,
                "other": _other_gemms(f.other_gemms, recipes)}
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # a hand-edited audit.json: no section
        log.warning("the fp8 section of audit.json is not as precision-audit writes it (%s): not shown", e)
        return None
