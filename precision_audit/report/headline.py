"""The report's verdict box and its list of warnings, read from the audit's typed record (docs/report.md,
sections ``verdict`` and ``warnings``).

Example::

    h = headline(record, record.formats)
    h["sentence"], h["speedup"], h["loss"], h["fp16"]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import record as R
from .grouped import off_default, why_chosen
from .groups import Grouping, compress_names, grouping
from .numbers import fmt_num, fmt_scale
from .picks import given, is_gap, note_of, relative_to_fp32, speedup, step_time, summary_of


def headline(audit: R.AuditRecord, formats: list[str], g: Grouping | None = None) -> dict[str, Any]:
    """The plan in one sentence, every module it moves off the default format (FP8 included), why the default
    won, the estimated speedup, the expected loss change and FP16's viability."""
    plan = audit.plan
    d = plan.default_format if plan.default_format is not None else "fp32"
    g = g if g is not None else grouping(audit.layers or [])
    moves = off_default(audit, g)
    keep = [f"{n} module{'s' if n != 1 else ''} in {fmt}" for fmt, _, n in moves]
    target_name = (audit.target or {}).get("name")
    if not formats:
        sentence = "No low-precision format was audited: keep training in fp32."
    else:
        sentence = (f"Train with {d} autocast by default" + (", with " + " and ".join(keep) if keep else "")
                    + (f" on {target_name}" if target_name else "") + ".")
    h: dict[str, Any] = {"sentence": sentence, "default": d, "unsafe": audit.verdict.exit_code == 1,
                         "moves": moves, "why": why_chosen(plan)}

    # Estimated speedup of the default format over fp32 on the target.
    sp = speedup(audit, d) if d != "fp32" else None
    if sp is not None:
        h["speedup"] = (f"{sp:.2f}× for an all-{d} step over fp32 (estimate from the cost model"
                        + (", before the plan's overrides" if moves else "") + ")")
        h["speedup_ok"] = True
    else:
        st = step_time(audit, d) if summary_of(audit, d) is not None else step_time(audit, "fp32")
        note = st.estimated_note if st is not None else None
        h["speedup"] = note if is_gap(note) else "not measured: no estimated step time in this audit.json"
        h["speedup_ok"] = False

    h["loss"], h["loss_ok"] = _expected_loss(audit, d)
    h["fp16"], h["fp16_ok"] = _fp16(audit, formats)
    return h


def _expected_loss(audit: R.AuditRecord, d: str) -> tuple[str, bool]:
    """Expected loss change: measured with the plan applied (its verification pass), the planner's first-order
    prediction, and (without a verification) the all-default-format pass."""
    plan = audit.plan
    parts = []
    ver = plan.verification if given(plan.verification) else None
    budget_rel = (audit.options.budget or {}).get("max_loss_rel_change") if audit.options else None
    if ver is not None and isinstance(ver.loss_rel_change, (int, float)):
        within = ver.within_budget
        parts.append(f"measured {fmt_num(ver.loss_rel_change)} relative to FP32 with the plan applied "
                     f"({ver.source or 'verification pass'}"
                     + (f"; budget {fmt_num(budget_rel)}" if budget_rel is not None else "")
                     + ("" if within is None else ", within it" if within else ", over it") + ")")
    elif ver is not None and ver.error:
        parts.append(f"the verification pass failed: {ver.error}")
    if isinstance(plan.predicted_loss_rel_change, (int, float)):
        parts.append(f"predicted {fmt_num(plan.predicted_loss_rel_change)} (first-order, calibrated against the "
                     "all-format passes)")
    elif isinstance(plan.predicted_loss_change, (int, float)):
        # like with like: the measured figures beside it are relative to the FP32 loss, so this one is too
        rel = relative_to_fp32(plan.predicted_loss_change, audit)
        if rel is not None:
            parts.append(f"predicted {fmt_num(rel)} relative to FP32 for the plan (first-order, uncalibrated)")
        else:
            parts.append(f"predicted {fmt_num(plan.predicted_loss_change)} for the plan in the loss's own units "
                         "(first-order; not comparable with a relative change: the FP32 loss is 0 or not finite)")
    s = summary_of(audit, d)
    if d != "fp32" and isinstance(s, R.FormatSummary) and "loss_rel_change" not in s.absent and ver is None:
        parts.append(f"measured {fmt_num(s.loss_rel_change)} relative to FP32 in the all-{d} pass"
                     + (f" (budget {fmt_num(budget_rel)})" if budget_rel is not None else ""))
    ok = ver is None or (ver.within_budget is not False and not ver.error)
    text = "; ".join(parts) if parts else (
        "none: the plan keeps fp32" if d == "fp32" else "not measured: no pass in the default format")
    return text, ok


def _fp16(audit: R.AuditRecord, formats: list[str]) -> tuple[str, bool]:
    ls = audit.loss_scale if given(audit.loss_scale) else None
    skipped = {x.format: x.reason for x in audit.formats_skipped or []}
    if "fp16" in formats and ls is not None:
        if ls.viable:
            gd: Mapping[str, Any] = ls.gradscaler_default or {}
            extra = ""
            if gd.get("skipped_steps") is not None:
                extra = (f"; torch.amp.GradScaler's defaults (init {fmt_scale(gd.get('init_scale'))}) skip "
                         f"{gd.get('skipped_steps')} step(s) at the start")
            return f"viable with loss scale {fmt_scale(ls.recommended_init_scale)}{extra}", True
        return f"not viable as is: {ls.reason if ls.reason is not None else ''}", False
    if "fp16" in skipped:
        return skipped["fp16"], False
    return "not measured: fp16 was not among the audited formats", False


def warnings(audit: R.AuditRecord, formats: list[str]) -> list[str]:
    """audit.json's warnings, then every "not measured" note, each once."""
    w: list[str] = list(audit.warnings or [])
    for s in audit.formats_skipped or []:
        w.append(f"{s.format}: {s.reason}")
    notes: list[str] = []
    for f in ["fp32", *formats]:
        st = step_time(audit, f)
        for note, what in ((st.measured_note if st else None, "measured step time"),
                           (st.estimated_note if st else None, "estimated step time")):
            if is_gap(note):
                notes.append(f"{what}: {note}")
    layers = audit.layers or []
    notes += [f"Tensor Core alignment: {L.alignment_note}" for L in layers
              if not L.alignment and is_gap(L.alignment_note)]
    notes += [f"per-layer cost: {L.cost_note}" for L in layers if not given(L.cost) and is_gap(L.cost_note)]
    local_missing: dict[str, list[str]] = {}
    for L in layers:
        for e in (L.error or {}).values():
            if isinstance(e, R.LayerError) and e.local is None and e.local_note:
                local_missing.setdefault(e.local_note, []).append(L.name or "(model)")
    g = grouping(layers) if local_missing else None
    for note, mods in local_missing.items():
        uniq = compress_names(mods, g) if g is not None else mods  # a block's repeats written once: h.*.mlp
        notes.append(f"local error not measured for {', '.join(uniq[:5])}{' …' if len(uniq) > 5 else ''}: {note}")
    memory = audit.memory if isinstance(audit.memory, R.Memory) else None
    for rec in ((memory.per_format if memory else None) or {}).values():
        if isinstance(rec, R.FormatMemory) and is_gap(rec.peak_note):
            notes.append(f"peak GPU memory: {rec.peak_note}")
    for key, what in (("verify", "A/B training run (precision-audit verify)"), ("memory", "memory per format"),
                      ("estimates", "step-time estimates")):
        if not given(getattr(audit, key)):
            notes.append(f"{what}: " + note_of(audit, key, "not measured: not in this audit.json"))
    for n in notes:
        if n not in w:
            w.append(n)
    return w
