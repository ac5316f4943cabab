"""report.html: its structure for every sample model, escaping, optional fields, and `precision-audit report`."""

from __future__ import annotations

import copy
import json
import re
import textwrap
from html.parser import HTMLParser

import pytest
from markupsafe import escape

from conftest import SAMPLES
from precision_audit.record.codec import from_json
from precision_audit.report import charts
from precision_audit.report.html import SECTIONS, fmt_num, fmt_scale, render_html

SAMPLE_CASES = [(name, {}) for name in SAMPLES] + [("fp16_trouble", {"target": "v100"})]
SAMPLE_IDS = [n for n in SAMPLES] + ["fp16_trouble-v100"]
TIMESTAMP = re.compile(r'<time id="generated"[^>]*>[^<]*</time>')


class ReportDOM(HTMLParser):
    """What the structure tests need from a page: ids, links, tables (rows per tbody), scripts, headers."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.urls: list[tuple[str, str, str]] = []  # (tag, attribute, value)
        self.tables: dict[str, dict] = {}
        self.scripts: list[dict] = []
        self.th_in_thead: list[dict] = []
        self.time_generated = 0
        self._table: list[dict] = []
        self._in_thead = False
        self._in_tbody = False
        self._script: dict | None = None
        self.feed(html)
        self.close()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        for k in ("src", "href", "action", "srcset", "poster", "data", "xlink:href"):
            if k in a and a[k] is not None:
                self.urls.append((tag, k, a[k]))
        if tag == "table":
            t = {"id": a.get("id"), "rows": 0, "caption": False, "class": a.get("class", "")}
            self._table.append(t)
            if a.get("id"):
                self.tables[a["id"]] = t
        elif tag == "caption" and self._table:
            self._table[-1]["caption"] = True
        elif tag == "thead":
            self._in_thead = True
        elif tag == "tbody":
            self._in_tbody = True
        elif tag == "tr" and self._in_tbody and self._table:
            self._table[-1]["rows"] += 1
        elif tag == "th" and self._in_thead:
            self.th_in_thead.append(a)
        elif tag == "script":
            self._script = {"attrs": a, "text": ""}
        elif tag == "time" and a.get("id") == "generated":
            self.time_generated += 1

    def handle_endtag(self, tag):
        if tag == "table" and self._table:
            self._table.pop()
        elif tag == "thead":
            self._in_thead = False
        elif tag == "tbody":
            self._in_tbody = False
        elif tag == "script" and self._script is not None:
            self.scripts.append(self._script)
            self._script = None

    def handle_data(self, data):
        if self._script is not None:
            self._script["text"] += data

    def script_by_id(self, id_: str) -> str:
        (s,) = [s for s in self.scripts if s["attrs"].get("id") == id_]
        return s["text"]


def external_urls(dom: ReportDOM) -> list[tuple[str, str, str]]:
    """src/href values that would reach outside the page: anything but #fragments and data: URLs."""
    return [u for u in dom.urls if not (u[2].startswith("#") or u[2].startswith("data:"))]


@pytest.fixture(scope="module", params=SAMPLE_CASES, ids=SAMPLE_IDS)
def sample_report(request, sample_audits):
    name, options = request.param
    _, out, _ = sample_audits.get(name, **options)
    html = (out / "report.html").read_text(encoding="utf-8")
    return name, out, json.loads((out / "audit.json").read_text()), json.loads((out / "policy.json").read_text()), html


def test_one_row_per_layer_in_the_layer_and_plan_tables(sample_report):
    name, _, audit, _, html = sample_report
    dom = ReportDOM(html)
    n = len(audit["layers"])
    assert dom.tables["layer-table"]["rows"] == n, f"{name}: layer table rows vs audit.json layers"
    assert dom.tables["plan-table"]["rows"] == n, f"{name}: plan table rows vs audit.json layers"
    shown = {"fp32", *audit["formats"], *(s["format"] for s in audit["formats_skipped"])}
    estimate_only = [f for f in (audit.get("estimates") or {}).get("step_time_s", {}) if f not in shown]
    assert dom.tables["format-table"]["rows"] == len(shown) + len(estimate_only)
    assert {f"layer-{i}" for i in range(n)} <= dom.ids


def test_every_section_is_present(sample_report):
    name, _, _, _, html = sample_report
    dom = ReportDOM(html)
    missing = [s for s, _ in SECTIONS if s not in dom.ids]
    assert not missing, f"{name}: sections missing: {missing}"
    for chart in ("chart-error", "chart-ranges", "chart-grad-hist", "chart-time", "chart-verify"):
        assert chart in dom.ids, f"{name}: {chart} missing"
    for svg in ("chart-error-svg", "chart-ranges-svg", "chart-grad-hist-svg"):
        assert svg in dom.ids, f"{name}: the {svg} chart was not drawn"


def test_no_external_url_and_one_timestamp(sample_report):
    _, _, _, _, html = sample_report
    dom = ReportDOM(html)
    assert external_urls(dom) == []
    assert dom.time_generated == 1, "exactly one generation timestamp"
    assert len(TIMESTAMP.findall(html)) == 1
    for s in dom.scripts:
        assert "src" not in s["attrs"], "scripts are inline"
    assert "<link rel=\"stylesheet\"" not in html and "@import" not in html


def test_embedded_policy_equals_policy_json(sample_report):
    _, out, _, policy, html = sample_report
    dom = ReportDOM(html)
    assert json.loads(dom.script_by_id("policy-data")) == policy
    (href,) = [u[2] for u in dom.urls if u[0] == "a" and u[2].startswith("data:application/json")]
    from urllib.parse import unquote

    assert json.loads(unquote(href.split(",", 1)[1])) == policy
    assert (out / "policy.json").read_text() == unquote(href.split(",", 1)[1]), "the download is policy.json itself"


def test_tables_are_accessible(sample_report):
    _, _, _, _, html = sample_report
    dom = ReportDOM(html)
    assert dom.th_in_thead and all(th.get("scope") == "col" for th in dom.th_in_thead)
    for tid in ("format-table", "layer-table", "plan-table"):
        assert dom.tables[tid]["caption"], f"{tid} has a caption"
        assert "sortable" in dom.tables[tid]["class"]
    untitled = [th for th in dom.th_in_thead if not th.get("title")]
    assert untitled == [], "every column header defines its figure (and unit) in a tooltip"
    assert 'lang="en"' in html and "prefers-color-scheme: dark" in html and "@media print" in html


def test_absent_fields_say_not_measured(sample_report):
    """An audit.json without alignment, cost, estimates, memory and verify says "not measured: <why>" for each."""
    _, _, audit, policy, _ = sample_report
    a = copy.deepcopy(audit)
    for L in a["layers"]:
        L["alignment"], L["alignment_note"] = None, "not measured: alignment why"
        L["cost"], L["cost_note"] = None, "not measured: cost why"
    for s in a["summary"].values():
        s["step_time"].update(estimated_s=None, estimated_note="not measured: estimate why")
    for k in ("estimates", "memory", "verify"):
        a.pop(k, None)
    a["memory_note"] = "not measured: memory why"
    html = render_html(from_json(a), policy)

    def section(sid: str) -> str:
        return html.split(f'id="{sid}"')[1].split("</section>")[0]

    assert "not measured: alignment why" in section("alignment")
    assert "not measured: memory why" in section("memory")
    assert "not measured:" in section("verify")
    assert "Estimated time per layer per format — not measured: cost why" in html
    assert "not measured: estimate why" in section("verdict"), "no speedup estimate: the verdict says why"
    for why in ("alignment why", "cost why", "estimate why", "memory why"):
        assert why in section("warnings"), f"{why!r} is listed under warnings"
    assert "est. time fp32" not in html and "gemm-table" not in html


def test_measured_alignment_cost_and_memory_are_shown(sample_audits):
    _, out, _ = sample_audits.get("tiny_gpt")
    audit = json.loads((out / "audit.json").read_text())
    html = (out / "report.html").read_text()
    dom = ReportDOM(html)
    # The LM head's vocabulary dimension (257) with its padded size and the estimated saving.
    align = html.split('id="alignment"')[1].split("</section>")[0]
    assert dom.tables["alignment-table"]["rows"] >= 1 and "lm_head" in align and ">264<" in align
    assert "ns" in align or "µs" in align
    # one row per module with GEMM-family ops of its own, aligned ones included (issue 35: GPT-2's Conv1D GEMMs,
    # all aligned, had no row when the table listed only the ops with an alignment finding)
    with_gemms = [L for L in audit["layers"] if (L["cost"] or {}).get("gemm_ops") or L["alignment"]]
    assert dom.tables["gemm-table"]["rows"] == len(with_gemms) > sum(bool(L["alignment"]) for L in audit["layers"])
    assert "chart-time-svg" in dom.ids and "est. time bf16" in html
    assert dom.tables["memory-table"]["rows"] == len(audit["memory"]["per_format"])
    for advice in audit["memory"]["advice"]:
        assert str(escape(advice)) in html
    verdict = html.split('id="verdict"')[1].split("</section>")[0]
    assert f"{audit['estimates']['speedup_vs_fp32']['bf16']:.2f}×" in verdict


def test_verify_curves_are_drawn_when_present(sample_audits):
    _, out, _ = sample_audits.get("tiny_gpt")
    audit = json.loads((out / "audit.json").read_text())
    audit["verify"] = {"steps": 6, "curves": {"fp32": [5.5, 5.2, 4.9, 4.7, 4.6, 4.5],
                                              "policy": [5.5, 5.2, 4.91, 4.71, 4.6, 4.51],
                                              "fp16": [5.5, 5.3, None, 4.9, 4.8, 4.7]},
                       "errors": {}, "final_divergence": {"policy": 0.002, "fp16": 0.04}}
    html = render_html(from_json(audit), json.loads((out / "policy.json").read_text()))
    dom = ReportDOM(html)
    assert "chart-verify-svg" in dom.ids
    verify = html.split('id="verify"')[1].split("</section>")[0]
    assert "final divergence" in verify and "not measured" not in verify
    svg = html.split('id="chart-verify-svg"')[1].split("</svg>")[0]
    assert svg.count("<polyline") == 4, "fp32, policy, and fp16 broken in two at its non-finite step"
    assert "non-finite loss" in svg


# --- escaping ----------------------------------------------------------------------------------------------

EVIL = "<script>alert(1)</script>"


def test_module_names_are_escaped_never_executed(tmp_path):
    from precision_audit.audit import AuditOptions, run_audit

    model = tmp_path / "evil.py"
    model.write_text(textwrap.dedent(f"""
        import torch
        from torch import nn

        def build_model():
            m = nn.Sequential(nn.Linear(8, 8))
            m.add_module({EVIL!r}, nn.Linear(8, 4))
            m.add_module('x" onmouseover="alert(2)', nn.ReLU())
            return m

        def sample_batch():
            return torch.randn(4, 8)
        """))
    result = run_audit(AuditOptions(model=str(model), out=tmp_path / "out", steps=0))
    html = (tmp_path / "out" / "report.html").read_text()
    assert "<script>alert" not in html
    assert 'onmouseover="alert' not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    dom = ReportDOM(html)
    assert dom.tables["layer-table"]["rows"] == len(result.audit["layers"])
    assert [s["attrs"].get("type") for s in dom.scripts] == ["application/json", None], "only our two scripts"
    assert json.loads(dom.script_by_id("policy-data")) == json.loads((tmp_path / "out" / "policy.json").read_text())


def test_policy_json_cannot_close_its_script_block():
    audit = json.loads(json.dumps(_minimal_audit()))
    policy = {"schema": "precision-audit/policy", "modules": {EVIL: {"format": "fp32", "reason": "</script><!--"}}}
    html = render_html(from_json(audit), policy)
    dom = ReportDOM(html)
    assert json.loads(dom.script_by_id("policy-data")) == policy
    assert "<script>alert" not in html and "</script><!--" not in html


def test_charts_escape_names():
    svg = charts.error_by_layer([EVIL], {"fp16": charts.ErrorSeries(local=[1e-3], accumulated=[None],
                                                                    local_missing=[False])})
    assert "<script>" not in svg and "&lt;script&gt;" in svg


# --- precision-audit report ----------------------------------------------------------------------------


def test_report_command_reproduces_the_page(sample_audits, tmp_path, capsys):
    from precision_audit.cli.report import report_main

    _, out, _ = sample_audits.get("tiny_gpt")
    original = (out / "report.html").read_text()
    assert report_main([str(out / "audit.json"), "--out", str(tmp_path / "again")]) == 0
    again = (tmp_path / "again" / "report.html").read_text()
    assert str(tmp_path / "again" / "report.html") in capsys.readouterr().out
    assert TIMESTAMP.sub("", again) == TIMESTAMP.sub("", original), "same bytes apart from the timestamp"
    assert again.encode() != b"" and len(TIMESTAMP.findall(again)) == 1


def test_report_command_without_policy_says_not_available(sample_audits, tmp_path):
    from precision_audit.cli.report import report_main

    _, out, _ = sample_audits.get("mlp")
    (tmp_path / "audit.json").write_text((out / "audit.json").read_text())
    assert report_main([str(tmp_path / "audit.json"), "--quiet"]) == 0
    html = (tmp_path / "report.html").read_text()
    assert "not available: no policy.json" in html
    assert ReportDOM(html).script_by_id("policy-data") == "null"


@pytest.mark.parametrize("content, words", [
    (None, ["not found"]),
    ("{not json", ["not JSON", "line 1"]),
    ('{"schema": "precision-audit/policy", "version": 1}', ["not an audit.json", "precision-audit/audit"]),
    ('{"schema": "precision-audit/audit", "version": 99}', ["version 99"]),
], ids=["missing", "not-json", "a-policy", "future-version"])
def test_report_command_user_errors(tmp_path, capsys, content, words):
    from precision_audit.cli.report import report_main

    path = tmp_path / "audit.json"
    if content is not None:
        path.write_text(content)
    assert report_main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for w in words:
        assert w in err, f"{w!r} missing from {err}"
    assert not (tmp_path / "report.html").exists()


# --- small pieces --------------------------------------------------------------------------------------


def test_rendering_is_deterministic(sample_audits):
    import datetime as dt

    _, out, _ = sample_audits.get("cnn")
    audit, policy = json.loads((out / "audit.json").read_text()), json.loads((out / "policy.json").read_text())
    when = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    assert render_html(from_json(audit), policy, when) == render_html(from_json(copy.deepcopy(audit)),
                                                                    copy.deepcopy(policy), when)


@pytest.mark.parametrize("x, text", [(None, "inf/NaN"), (0.0, "0"), (12345, "12,345"), (1.5e-4, "1.50e-04"),
                                     (0.25, "0.25"), (True, "yes")], ids=str)
def test_fmt_num(x, text):
    assert fmt_num(x) == text


def test_fmt_scale():
    assert fmt_scale(131072.0) == "2^17 (131,072)" and fmt_scale(1.0) == "1 (none)" and fmt_scale(None) == "—"


def _minimal_audit() -> dict:
    """The smallest audit.json the template accepts: no formats, no layers (every optional part absent)."""
    return {"schema": "precision-audit/audit", "version": 1, "tool": {"name": "precision-audit", "version": "0"},
            "created": "2026-01-01T00:00:00+00:00", "mode": "emulated", "device": "cpu",
            "hardware": {"cuda_available": False, "gpus": [], "torch_version": "2"},
            "target": {"name": "H100 SXM", "compute_capability": [9, 0]}, "formats": [], "formats_skipped": [],
            "options": {}, "model": {"class": "M", "parameters": 0, "fingerprint": "sha256:" + "0" * 64,
                                     "modules": 1, "training": False},
            "batch": {}, "loss": {"kind": "surrogate"}, "emulation": None,
            "summary": {"fp32": {"loss": 1.0, "step_time": {"measured_s": None, "measured_on": None,
                                                            "estimated_s": None, "estimated_note": None}}},
            "loss_scale": None, "layers": [],
            "plan": {"default_format": "fp32", "overrides": {}},
            "verdict": {"exit_code": 0, "safe_formats": [], "message": "no low-precision format was audited"},
            "warnings": []}


def test_minimal_audit_renders_every_section():
    html = render_html(from_json(_minimal_audit()), None)
    dom = ReportDOM(html)
    assert all(s in dom.ids for s, _ in SECTIONS)
    assert dom.tables["layer-table"]["rows"] == 0
    assert "keep training in fp32" in html
