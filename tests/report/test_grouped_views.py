"""The report for models with many modules (issue 35; docs/report.md, "Models with hundreds of layers"): repeated
blocks found in the module tree and shown once with the spread over their repeats, the outliers named; every module
the policy moves off the default format named, FP8 included, in the verdict box and the terminal; and the rule that
chose between formats of equal estimate said where people look.

The grouping is view logic (report/groups.py) over names, types and own parameter counts: it is checked here on
hand-made module trees whose groups are known, and on the stored sample audits."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from precision_audit.record.codec import from_json
from precision_audit.report.grouped import FORMAT_ORDER, TIME_TIE, off_default, why_chosen
from precision_audit.report.groups import compress_names, grouping, spread
from precision_audit.report.html import render_html
from precision_audit.report.terminal import summary_text

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def _golden(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.audit.json").read_text())


def _tree(spec: list[tuple[str, str, int]]) -> list[SimpleNamespace]:
    return [SimpleNamespace(name=n, type=t, own_parameters=p) for n, t, p in spec]


def _blocks(n: int, extra: list[tuple[str, str, int]] = ()) -> list[SimpleNamespace]:  # type: ignore[assignment]
    spec = [("", "Net", 0), ("emb", "Embedding", 100)]
    for i in range(n):
        spec += [(f"h.{i}", "Block", 0), (f"h.{i}.attn", "Attn", 0), (f"h.{i}.attn.q", "Linear", 72),
                 (f"h.{i}.attn.k", "Linear", 72), (f"h.{i}.mlp", "Linear", 90)]
    return _tree(spec + [("head", "Linear", 90), *extra])


def test_repeated_blocks_are_one_group_with_their_paths():
    g = grouping(_blocks(5))
    assert [(x.label, x.type, len(x.members)) for x in g.groups] == [("h.*", "Block", 5)]
    grp = g.groups[0]
    assert grp.paths == ["", "attn", "attn.q", "attn.k", "mlp"]
    assert grp.column("attn.k") == [5 + 5 * i for i in range(5)]  # the layer index of h.i.attn.k
    # inside a group nothing is grouped again: attn.q and attn.k (same type and size) stay two paths
    assert len(g.placed) == 25
    # the chart axis: the top-level modules and each repeat
    assert [u[2] for u in g.units] == ["emb", "h.0", "h.1", "h.2", "h.3", "h.4", "head"]
    assert g.units[1] == (2, 6, "h.0")


def test_a_repeat_that_differs_is_not_in_the_group():
    layers = _blocks(4)
    layers[3 + 5 * 2].own_parameters = 144  # h.2.attn.q is twice as wide: h.2 has another signature
    g = grouping(layers)
    assert g.groups[0].members == ["h.0", "h.1", "h.3"]
    assert g.groups[0].label == "h.{0,1,3}"  # not "h.*": the pattern would name h.2 too


def test_few_leaves_stay_rows_and_many_leaves_group():
    two_relus = _tree([("", "MLP", 0), ("fc1", "Linear", 10), ("act1", "ReLU", 0), ("fc2", "Linear", 20),
                       ("act2", "ReLU", 0)])
    assert grouping(two_relus).groups == []
    flat = _tree([("", "Sequential", 0)] + [(str(i), "Linear" if i % 2 == 0 else "Tanh", 72 if i % 2 == 0 else 0)
                                            for i in range(500)])
    g = grouping(flat)
    assert [(x.type, len(x.members)) for x in g.groups] == [("Linear", 250), ("Tanh", 250)]
    assert (g.groups[0].label, g.groups[1].label) == ("{0,2,…,498}", "{1,3,…,499}")


def test_compress_names_writes_a_complete_column_once():
    g = grouping(_blocks(3))
    names = ["emb", "h.0.mlp", "h.1.mlp", "h.2.mlp", "h.1.attn.q", "head"]
    assert compress_names(names, g) == ["emb", "h.*.mlp", "h.1.attn.q", "head"]
    assert compress_names(["h.0.mlp", "h.2.mlp"], g) == ["h.0.mlp", "h.2.mlp"]  # not every repeat: each named


def test_spread_names_the_worst_and_the_outliers():
    vals = [(str(i), 1e-3) for i in range(20)] + [("20", 9e-3), ("21", None), ("22", 2e-3)]
    s = spread(vals)
    assert s is not None and s.median == 1e-3 and (s.lo, s.hi) == (1e-3, 9e-3) and s.n == 22
    assert s.worst == "20" and s.outliers == ["20"]  # 9x the median; 2x is not an outlier
    h = spread([("a", 10.0), ("b", 9.5), ("c", 6.0), ("d", 10.5)], worse="low", bits=True)
    assert h is not None and h.worst == "c" and h.outliers == ["c"]  # 4 bits below the median of 9.75
    assert spread([("a", None)]) is None


def test_the_tie_rule_is_the_planners():
    from precision_audit.planning.planner import FORMAT_PREFERENCE
    from precision_audit.planning.select import TIME_TIE as PLANNER_TIE

    assert TIME_TIE == PLANNER_TIE
    assert FORMAT_ORDER == tuple(f.value for f in FORMAT_PREFERENCE)


def test_why_bf16_over_fp16_of_equal_estimate_is_said(capsys):
    """tiny_gpt: fp16 (8x less output error) and bf16 are estimated equal; bf16 wins on no loss scaling."""
    r = from_json(_golden("tiny_gpt"))
    why = why_chosen(r.plan)
    assert why is not None and "uniform fp16" in why and "no loss scaling" in why and "docs/plan.md" in why
    html = render_html(r, None)
    verdict = html.split('id="verdict"')[1].split("</section>")[0]
    assert "Why bf16" in verdict and "no loss scaling" in verdict
    assert "why bf16: " in summary_text(r) and "no loss scaling" in summary_text(r)


def _with_overrides(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    for i in (0, 1):
        doc["plan"]["overrides"][f"blocks.{i}.mlp.c_fc"] = {"format": "fp32", "reason": f"kept in fp32 ({i})"}
    doc["plan"]["overrides"]["lm_head"] = {"format": "fp16", "reason": "fp16 is faster here"}
    doc["fp8"] = {"plan": {"modules": {
        "blocks.0.attn.c_attn": {"recipe": "fp8_tensorwise", "reason": "fp8_tensorwise: local error 3e-02"},
        "blocks.1.attn.c_attn": {"recipe": "fp8_tensorwise", "reason": "fp8_tensorwise: local error 3e-02"},
        "blocks.0.attn.c_proj": {"recipe": None, "reason": "kept"}}}}
    return doc


def test_every_module_off_the_default_is_named_fp8_included():
    r = from_json(_with_overrides(_golden("tiny_gpt")))
    moves = off_default(r, grouping(r.layers))
    assert moves == [("fp32", ["blocks.*.mlp.c_fc"], 2), ("fp16", ["lm_head"], 1),
                     ("fp8_tensorwise", ["blocks.*.attn.c_attn"], 2)]
    verdict = render_html(r, None).split('id="verdict"')[1].split("</section>")[0]
    for name in ("blocks.*.mlp.c_fc", "lm_head", "blocks.*.attn.c_attn"):
        assert f"<code>{name}</code>" in verdict
    assert "blocks.0.attn.c_proj" not in verdict  # the FP8 plan kept it
    text = summary_text(r)
    for name, fmt in (("blocks.0.mlp.c_fc", "fp32"), ("blocks.1.mlp.c_fc", "fp32"), ("lm_head", "fp16"),
                      ("blocks.0.attn.c_attn", "fp8_tensorwise"), ("blocks.1.attn.c_attn", "fp8_tensorwise")):
        assert re.search(rf"^    {re.escape(name)} -> {fmt}\b", text, re.M), (name, text)


def test_the_fp8_plan_of_a_real_audit_is_in_the_terminal_and_the_verdict(sample_audits):
    """The issue's run: --formats fp16,bf16,fp8_e4m3 --tokens-per-step 131072 puts linear layers in FP8, and the
    terminal said only "no overrides"."""
    result, out, _ = sample_audits.get("tiny_gpt", formats="fp16,bf16,fp8_e4m3", fp8_tokens_per_step=131072,
                                       steps=0)
    policy = json.loads((out / "policy.json").read_text())
    planned = {n: m["recipe"] for n, m in (policy.get("fp8") or {}).get("modules", {}).items()}
    assert planned, "the premise: the FP8 plan converts some linear layers at 131072 tokens per step"
    text = summary_text(result.audit)
    verdict = (out / "report.html").read_text().split('id="verdict"')[1].split("</section>")[0]
    for name, recipe in planned.items():
        assert f"    {name} -> {recipe} (FP8 plan" in text
    for recipe in set(planned.values()):
        assert f'<span class="fmt fmt-{recipe}">{recipe}</span>' in verdict


def test_the_grouped_table_shows_each_block_once_with_its_spread():
    doc = _golden("tiny_gpt")
    r = from_json(doc)
    from precision_audit.report.grouped import layer_rows

    rows = layer_rows(r, grouping(r.layers), r.formats)
    heads = [x for x in rows if x["kind"] == "group"]
    assert [(h["label"], h["repeats"]) for h in heads] == [("blocks.*", 2)]
    fc = next(x for x in rows if x.get("name") == "blocks.*.mlp.c_fc")
    vals = [L["error"]["bf16"]["local"]["rel_l2"] for L in doc["layers"] if L["name"].endswith("mlp.c_fc")]
    cell = fc["cells"][2]  # bf16 local
    assert cell["v"] == pytest.approx(sum(vals) / 2)  # the median of two
    worst = str(max(range(2), key=lambda i: vals[i]))
    assert cell["sub"].endswith(f"worst {worst}")
    assert len([x for x in rows if x["kind"] == "module"]) == len(doc["layers"]) - 20  # 2 blocks x 10 modules
