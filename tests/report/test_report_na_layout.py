"""Report and terminal figures that cannot exist read "n/a" with the reason, not "inf/NaN"; the expected loss
change is relative beside relative; a wide page fits a 1280-px window (issue 18 item 6, docs/report.md)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from precision_audit.record.codec import from_json
from precision_audit.report.html import render_html
from precision_audit.report.terminal import summary_text

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
RAISED = "RuntimeError: \"addmm_impl_cpu_\" not implemented for 'BFloat16'"


def _golden(name: str = "mlp") -> dict:
    return json.loads((GOLDEN / f"{name}.audit.json").read_text())


def _failed_bf16(doc: dict) -> dict:
    """The audit as it reads when the model raised under bf16 autocast (analysis/findings.py ``_summary``)."""
    s = doc["summary"]["bf16"]
    s.update(loss=None, loss_rel_change=None, output=None, pass_error=RAISED, safe=False,
             verdict=f"not measured: the model raised under bf16 autocast: {RAISED}",
             nonfinite={"outputs": 0, "param_grads": 0, "param_grads_also_in_fp32": 0})
    return doc


def _row(html: str, fmt: str) -> str:
    m = re.search(rf'<tr data-filter="{fmt}">(.*?)</tr>', html, re.S)
    assert m, f"no {fmt} row in the formats table"
    return m.group(1)


def test_a_pass_that_raised_reads_na_with_its_reason_in_the_report():
    html = render_html(from_json(_failed_bf16(_golden())), None)
    row = _row(html, "bf16")
    assert "inf/NaN" not in row
    assert row.count(">n/a<") == 6  # loss, loss change, output error, SQNR, cosine, non-finite counts
    assert "not implemented for &#39;BFloat16&#39;" in row  # the reason, in the cells' tooltips and the verdict
    assert "inf/NaN" not in _row(render_html(from_json(_golden()), None), "bf16")  # and a normal row has none


def test_a_pass_that_raised_reads_na_in_the_terminal_summary():
    text = summary_text(from_json(_failed_bf16(_golden())))
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("bf16"))
    assert "inf/NaN" not in line and line.split()[1:5] == ["n/a"] * 4
    assert "the model raised under bf16 autocast" in line


def test_a_format_the_target_lacks_reads_na_in_its_peaks():
    doc = _golden()
    doc["target"]["name"] = "V100 SXM2"
    doc["target"]["peak_tflops"].update(bf16=None, tf32=None)
    html = render_html(from_json(doc), None)
    peaks = re.search(r"<dt>Target peaks</dt><dd>(.*?)</dd>", html, re.S).group(1)
    assert "inf/NaN" not in peaks
    assert "bf16 <span" in peaks and "n/a (no bf16 Tensor Cores)" in peaks and "n/a (no tf32 Tensor Cores)" in peaks


def test_an_absolute_prediction_is_shown_relative_beside_the_relative_measurements():
    doc = _golden()
    doc["summary"]["fp32"]["loss"] = 4.0
    doc["plan"]["predicted_loss_change"] = 0.02  # in the loss's units: 0.005 of the FP32 loss
    doc["plan"]["predicted_loss_rel_change"] = None
    html = render_html(from_json(doc), None)
    expected = re.search(r"<dt>Expected loss change</dt><dd[^>]*>(.*?)</dd>", html, re.S).group(1)
    assert "relative to FP32 with the plan applied" in expected  # the measured figure: relative
    assert "predicted 0.005 relative to FP32" in expected
    assert "absolute" not in expected and "0.02 " not in expected
    plan = re.search(r'<section id="plan".*?</section>', html, re.S).group(0)
    assert "0.005 relative to FP32" in plan


def _wide_doc() -> dict:
    """A schema-valid audit.json with what makes a page wide: long paths, a long module name, many columns."""
    doc = copy.deepcopy(_golden("tiny_gpt"))
    long = "/home/someone/" + "very_long_directory_name_" * 12 + "model.py"
    doc["options"]["model"] = doc["model"]["source"] = long
    doc["warnings"].append("the file " + long + " was read")
    doc["layers"][3]["name"] = "transformer.blocks." + "deeply_nested_submodule_" * 8 + "attn"
    doc["memory_extra_" + "x" * 150] = {f"column_{i}_with_a_long_name": 123456.789 * i for i in range(24)}
    doc["runs_detail"] = [{f"column_number_{i}_with_a_long_name": 123456.789 * i for i in range(24)}]
    return doc


def test_a_wide_page_fits_a_1280_px_window(tmp_path):
    from test_report_browser import CHROMIUM, Chromium

    if not Path(CHROMIUM).exists():
        pytest.skip(f"headless Chromium not available: {CHROMIUM} is missing")
    doc = _wide_doc()
    doc["verify"] = {"steps": 3, "optimizer": "adam", "lr": 1e-3, "seed": 0, "mode": "emulated",
                     "curves": {"fp32": [1.0, 0.9], "policy": [1.0, 0.9]}, "skipped_steps": {}, "errors": {},
                     "final_loss_rel_change": {}, "param_rel_change": {}, "policy_failure": None,
                     "policy_safe": True, "detail": [{f"col_{i}_" + "y" * 20: i for i in range(30)}]}
    page = tmp_path / "report.html"
    page.write_text(render_html(from_json(doc), None))
    b = Chromium(tmp_path / "profile")
    try:
        b.open(page)
        width, window = b.eval("[document.documentElement.scrollWidth, window.innerWidth]")
        assert window == 1280 and width <= window, f"the page scrolls sideways: {width} px in a {window}-px window"
        # the wide tables are still whole: they scroll inside their own box
        inner = b.eval("Math.max(...Array.from(document.querySelectorAll('.tablewrap, table.generic'))"
                       ".map(e => e.scrollWidth - e.clientWidth))")
        assert inner > 0
    finally:
        b.close()
