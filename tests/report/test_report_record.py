"""report.html is rendered from the audit's typed record (issue 13; docs/record.md, "Who reads the record"):
every stored audit.json (tests/golden/) read back with ``from_json`` renders a page whose tables hold exactly
the file's layers, formats and plan; the renderer takes the record only; and a record fresh from an audit
(non-finite figures as floats) renders the same page as the audit.json it is saved as."""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from pathlib import Path

import pytest
from markupsafe import escape

from precision_audit.record.codec import from_json, to_json
from precision_audit.report.html import SECTIONS, opt, render_html

GOLDEN = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists()) / "tests" / "golden"
FILES = sorted(GOLDEN.glob("*.audit.json"))
WHEN = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)


def _section(html: str, sid: str) -> str:
    return html.split(f'id="{sid}"', 1)[1].split("</section>", 1)[0]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name.split(".")[0])
def test_a_stored_audit_renders_its_own_layers_formats_and_plan(path):
    doc = json.loads(path.read_text())
    html = render_html(from_json(doc), None, WHEN)
    assert all(f'id="{sid}"' in html for sid, _ in SECTIONS)
    # one row per layer that ran, in the file's order, named as the file names it
    layer_rows = re.findall(r'<tr id="layer-(\d+)" data-filter="([^"]*)"', _section(html, "layers"))
    assert [int(i) for i, _ in layer_rows] == list(range(len(doc["layers"])))
    for (_, text), L in zip(layer_rows, doc["layers"]):
        assert text.startswith(str(escape(L["name"] or "(model)")) + " " + str(escape(L["type"])) + " ")
        assert text.endswith(" " + L["plan"]["format"])
    # one row per audited format after FP32, then the skipped ones, each with its reason
    formats = _section(html, "formats")
    rows = re.findall(r'<tr data-filter="([^"]+)">', formats)
    assert rows[:1 + len(doc["formats"])] == ["fp32", *doc["formats"]]
    for s in doc["formats_skipped"]:
        assert s["format"] in rows and str(escape(s["reason"])) in formats
    # the verdict and every override of the plan
    assert str(escape(doc["verdict"]["message"])) in _section(html, "verdict")
    plan = _section(html, "plan")
    for name, o in doc["plan"]["overrides"].items():
        assert f"<code>{escape(name or '(model)')}</code> → " in plan and str(escape(o["reason"])) in plan
    # the same record, written out and read back, renders the same page
    assert render_html(from_json(to_json(from_json(doc))), None, WHEN) == html


def test_the_renderer_takes_the_record_not_a_dict():
    doc = json.loads(FILES[0].read_text())
    with pytest.raises(TypeError, match="from_json"):
        render_html(doc, None, WHEN)  # type: ignore[arg-type]


def test_a_fresh_record_renders_as_its_saved_audit_json():
    """A record from the audit holds an overflowed figure as a float (inf); audit.json holds null. The page is
    the same either way: "inf/NaN" where the figure was expected."""
    doc = json.loads(next(p for p in FILES if "fp16_trouble" in p.name).read_text())
    fmt = doc["formats"][0]
    layer = next(i for i, L in enumerate(doc["layers"]) if L["error"][fmt]["accumulated"]["rel_l2"] is not None)
    fresh = from_json(doc)
    fresh.layers[layer].error[fmt].accumulated.rel_l2 = math.inf
    saved = json.loads(json.dumps(doc))
    saved["layers"][layer]["error"][fmt]["accumulated"]["rel_l2"] = None
    page = render_html(fresh, None, WHEN)
    assert page == render_html(from_json(saved), None, WHEN)
    assert page != render_html(from_json(doc), None, WHEN)  # the changed figure is on the page


def test_an_optional_field_left_out_reads_as_its_default_and_a_null_as_itself():
    doc = json.loads(FILES[0].read_text())
    doc["model"].pop("mode_note", None)
    record = from_json(doc)
    assert opt(record.model, "mode_note", "(default)") == "(default)"
    doc["model"]["mode_note"] = None
    assert opt(from_json(doc).model, "mode_note", "(default)") is None
    assert opt(record.model, "fingerprint", "(default)") == doc["model"]["fingerprint"]


def test_estimates_without_speedups_fall_back_to_the_ratio_of_step_times():
    doc = json.loads(next(p for p in FILES if "tiny_gpt" in p.name).read_text())
    del doc["estimates"]["speedup_vs_fp32"]  # optional in the schema: a hand-edited file may lack it
    record = from_json(doc)
    st = {f: doc["summary"][f]["step_time"]["estimated_s"] for f in ("fp32", "bf16")}
    assert record.estimated_speedup("bf16") == pytest.approx(st["fp32"] / st["bf16"], rel=1e-12)
    assert record.estimated_speedup("fp32") == 1.0
    html = render_html(record, None, WHEN)
    assert doc["plan"]["default_format"] == "bf16"
    assert f"{st['fp32'] / st['bf16']:.2f}× for an all-bf16 step" in _section(html, "verdict")
