"""The report's FP8 section, from audit.json's ``fp8`` section (docs/fp8.md): per layer and recipe the local error
and whether it meets the budget, saturation and flush shares, estimated speedup, and the plan's choice; the planned
FP8 share of GEMM FLOPs with its estimated speedup; torchao's auto_filter verdict beside ours."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _cell(rec: Mapping[str, Any], cost: Mapping[str, Any] | None) -> dict[str, Any]:
    local = rec.get("local", {}).get("output") or {}
    errs = [e for e in (_num(local.get("rel_l2")), _num(rec.get("local_per_token_rel_l2"))) if e is not None]
    ops = rec.get("operands") or {}
    sat = max((_num(o.get("saturated_share")) or 0.0 for o in ops.values() if isinstance(o, Mapping)), default=0.0)
    flush = max((_num(o.get("flushed_share")) or 0.0 for o in ops.values() if isinstance(o, Mapping)), default=0.0)
    stale = rec.get("stale_steps") or {}
    stale_n = sum(len(v) for v in stale.values() if isinstance(v, list)) if isinstance(stale, Mapping) else 0
    return {"error": max(errs) if errs else None, "ok": bool(rec.get("meets_budget")), "saturated": sat,
            "flushed": flush, "stale": stale_n if stale else None,
            "speedup": _num(cost.get("speedup_vs_bf16")) if isinstance(cost, Mapping) else None}


def _tokens(t: Any) -> str | None:
    """The rows per step the plan was priced at: one number when every layer had the same."""
    if not isinstance(t, Mapping) or not t:
        return None
    vals = sorted({v for v in t.values() if isinstance(v, int)})
    return None if not vals else str(vals[0]) if len(vals) == 1 else f"{vals[0]}-{vals[-1]}"


def _other_gemms(other: Any, recipes: list[str]) -> list[dict[str, Any]]:
    """Rows for matmul/bmm outside nn.Linear (audit.json ``fp8.other_gemms``)."""
    rows = []
    for o in other if isinstance(other, list) else []:
        per = o.get("recipes") if isinstance(o.get("recipes"), Mapping) else {}
        cells = {r: _cell(per[r], None) for r in recipes if isinstance(per.get(r), Mapping) and "local" in per[r]}
        rows.append({"name": f"{o.get('module') or '(root)'} {o.get('op')} #{o.get('index')}",
                     "shape": "{} @ {}".format("x".join(map(str, o.get("a_shape", []))),
                                               "x".join(map(str, o.get("b_shape", [])))),
                     "cells": cells, "reason": str(o.get("plan", ""))})
    return rows


def fp8_view(audit: Mapping[str, Any]) -> dict[str, Any] | None:
    """The template's view of ``audit["fp8"]``; None when absent or not as the tool writes it."""
    f: Any = audit.get("fp8")
    if not isinstance(f, Mapping):
        return None
    try:
        recipes = [r for r in f.get("recipes", {}) if isinstance(r, str)]
        p, a = f.get("plan"), f.get("torchao_auto_filter")
        plan: Mapping[str, Any] = p if isinstance(p, Mapping) else {}
        pmods = plan.get("modules", {}) if isinstance(plan.get("modules"), Mapping) else {}
        auto: Mapping[str, Any] = a if isinstance(a, Mapping) else {}
        rows = []
        for L in f.get("layers", []):
            name = str(L.get("name"))
            pm: Any = pmods.get(name, {}) if isinstance(pmods.get(name), Mapping) else {}
            cost: Any = pm.get("cost", {}) if isinstance(pm.get("cost"), Mapping) else {}
            cells = {r: _cell(L["recipes"][r], cost.get(r)) for r in recipes if r in L.get("recipes", {})}
            af: Any = auto.get(name, {}) if isinstance(auto.get(name), Mapping) else {}
            rows.append({"name": name, "shape": f"{L.get('in_features')}→{L.get('out_features')}",
                         "tokens": L.get("tokens"), "cells": cells, "recipe": pm.get("recipe"),
                         "reason": str(pm.get("reason", "")),
                         "auto_filter": ", ".join(f"{k.removeprefix('fp8_')}: {'convert' if v else 'skip'}"
                                                  for k, v in af.items() if v is not None)})
        return {"recipes": recipes, "rows": rows, "budget": _num((f.get("budget") or {}).get("max_local_rel_error")),
                "share": _num(plan.get("fp8_flop_share")),
                "speedup": _num(plan.get("estimated_linear_speedup_vs_bf16")),
                "target": (f.get("target") or {}).get("name"), "notes": [str(n) for n in f.get("notes", [])],
                "plan_note": f.get("plan_note"), "tokens_per_step": _tokens(plan.get("tokens_per_step")),
                "other": _other_gemms(f.get("other_gemms"), recipes)}
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # a hand-edited audit.json: no section
        log.warning("the fp8 section of audit.json is not as precision-audit writes it (%s): not shown", e)
        return None
