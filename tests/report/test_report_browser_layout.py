"""report.html at 1280 px in headless Chromium, for models with hundreds of layers (issue 35; docs/report.md,
"Models with hundreds of layers"): a 24-layer GPT-2 page at most 8,000 px tall with its per-module tables
collapsed, every module reachable by search and by a block row's click; no column of the Formats, Plan or Layers
table out of view without a visible scroll hint and a sticky first column; no chart label cut off.

The GPT-2 is transformers' GPT2Config(n_layer=24, n_embd=64) with 4 heads (64 is not divisible by the default
12), a 1,000-word vocabulary and a 2 x 16 batch, random weights: nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SAMPLES
from test_report_browser import browser  # noqa: F401 - the fixture: one headless Chromium per module

MAX_PAGE_PX = 8000
TABLES = ("format-table", "plan-table", "layer-table")


@pytest.fixture(scope="module")
def gpt2_report(browser, tmp_path_factory):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import precision_audit

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=24, n_embd=64, n_head=4, vocab_size=1000, n_positions=32))
    ids = torch.randint(0, 1000, (2, 16))
    out = tmp_path_factory.mktemp("gpt2-24")
    result = precision_audit.audit(model, {"input_ids": ids, "labels": ids}, out=out, steps=0, progress=False)
    return out / "report.html", result.audit


def _sample(sample_audits, name: str) -> Path:
    return sample_audits.get(name)[1] / "report.html"


def test_gpt2_24_report_is_short_with_every_table_collapsed(browser, gpt2_report):
    path, audit = gpt2_report
    assert len(audit["layers"]) > 250
    browser.open(path)
    assert browser.errors() == []
    height = browser.eval("document.documentElement.scrollHeight")
    assert height <= MAX_PAGE_PX, f"the 24-layer GPT-2 page is {height} px tall"
    assert browser.eval("document.documentElement.scrollWidth") <= 1280
    # collapsed to their summaries: the grouped table is there, the per-module tables are behind a click
    assert browser.eval("document.getElementById('layers-all').open") is False
    assert browser.eval("document.getElementById('plan-all').open") is False
    heads = browser.eval("Array.from(document.querySelectorAll('#layer-groups tr.group-head code'))"
                         ".map(c => c.textContent)")
    assert heads == ["transformer.h.*"]


def test_every_module_is_reachable_by_search(browser, gpt2_report):
    path, audit = gpt2_report
    browser.open(path)
    visible = """Array.from(document.querySelectorAll('#layer-table tbody tr'))
                 .filter(r => !r.hidden && r.offsetParent !== null).map(r => r.cells[0].textContent.trim())"""
    for name in [L["name"] for L in audit["layers"]][::7] + ["transformer.h.23.mlp.c_proj"]:
        browser.eval("document.getElementById('layers-all').open = false")
        browser.click("#layer-filter")
        browser.eval("document.getElementById('layer-filter').value = ''")
        browser.page("Input.insertText", {"text": name or "(model)"})
        shown = browser.eval(visible)
        assert (name or "(model)") in shown, f"searching {name!r} does not show its row (shown: {shown[:5]})"
    browser.eval("document.getElementById('layer-filter').value = ''")
    browser.click("#layer-filter")
    browser.page("Input.insertText", {"text": "h.*.mlp.c_proj"})
    assert browser.eval(visible) == [f"transformer.h.{i}.mlp.c_proj" for i in range(24)]
    assert browser.errors() == []


def test_a_block_row_shows_its_repeats_in_one_click(browser, gpt2_report):
    path, _ = gpt2_report
    browser.open(path)
    browser.click('a.show-repeats[data-p="attn.c_attn"]')
    rows = browser.eval("""Array.from(document.querySelectorAll('#layer-table tbody tr'))
                           .filter(r => !r.hidden && r.offsetParent !== null)
                           .map(r => r.cells[0].textContent.trim())""")
    assert rows == [f"transformer.h.{i}.attn.c_attn" for i in range(24)]
    assert browser.eval("document.getElementById('layer-filter').value") == "transformer.h.*.attn.c_attn"


def _overflow_report(browser, table_id: str) -> dict:
    """Whether any header cell of the table lies right of its scroll box, and what the page does about it."""
    return browser.eval(f"""(() => {{
        const t = document.getElementById({json.dumps(table_id)});
        const w = t.closest('.tablewrap'), box = w.getBoundingClientRect();
        const heads = Array.from(t.tHead.rows[t.tHead.rows.length - 1].cells);
        const off = heads.filter(h => h.getBoundingClientRect().right > box.right + 1).map(h => h.textContent.trim());
        const hint = w.previousElementSibling;
        const hinted = !!(hint && hint.classList.contains('scroll-hint') && !hint.hidden && hint.offsetParent
                          && hint.getBoundingClientRect().right <= window.innerWidth);
        const first = heads[0], sticky = getComputedStyle(first).position === 'sticky'
            && getComputedStyle(t.tBodies[0].rows[0].cells[0]).position === 'sticky';
        w.scrollLeft = w.scrollWidth;
        const stays = Math.abs(t.tBodies[0].rows[0].cells[0].getBoundingClientRect().left - box.left) < 3;
        w.scrollLeft = 0;
        return {{off: off, hinted: hinted, sticky: sticky, stays: stays, scrolls: w.classList.contains('scrolls'),
                 boxRight: box.right}};
    }})()""")


def _check_tables(browser, path: Path) -> dict[str, list[str]]:
    browser.open(path)
    browser.eval("document.querySelectorAll('details').forEach(d => d.open = true)")
    browser.eval("window.dispatchEvent(new Event('resize'))")
    offs = {}
    for tid in TABLES:
        r = _overflow_report(browser, tid)
        assert r["boxRight"] <= 1280, f"{path.parent.name} {tid}: its box reaches past the window"
        if r["off"]:
            assert r["scrolls"] and r["hinted"], f"{tid}: columns {r['off']} are out of view without a scroll hint"
            assert r["sticky"] and r["stays"], f"{tid}: the first column does not stay in view when scrolled"
        offs[tid] = r["off"]
    return offs


@pytest.mark.parametrize("name", SAMPLES)
def test_formats_and_plan_fit_and_a_wide_layer_table_says_it_scrolls(browser, sample_audits, name):
    offs = _check_tables(browser, _sample(sample_audits, name))
    assert offs["format-table"] == [] and offs["plan-table"] == [], offs


def test_gpt2_24_tables_fit_or_say_they_scroll(browser, gpt2_report):
    offs = _check_tables(browser, gpt2_report[0])
    assert offs["format-table"] == [] and offs["plan-table"] == [], offs
    assert offs["layer-table"], "the premise: 21+ columns do not fit 1280 px"


def test_no_chart_label_is_cut_off(browser, gpt2_report, tmp_path):
    """The gradient histogram's count axis read ".0,000,000" at 10 million values (the label ran off the SVG)."""
    from precision_audit.report.charts import Marker, exponent_histogram

    svg = exponent_histogram({-12: 20_000_000, -30: 3}, [Marker(-24.0, "FP16 flush", "flush", "marker flush")])
    css = (Path(__file__).resolve().parents[2] / "templates" / "report.css").read_text()
    page = tmp_path / "hist.html"
    page.write_text(f"<!doctype html><html><head><style>{css}</style></head><body><main>{svg}</main></body></html>")
    check = """Array.from(document.querySelectorAll('svg.chart')).flatMap(s => {
        const box = s.getBoundingClientRect();
        return Array.from(s.querySelectorAll('text')).filter(t => t.textContent.trim()).map(t => {
            const r = t.getBoundingClientRect();
            return [t.textContent.trim(), r.left >= box.left - 0.5 && r.right <= box.right + 0.5];
        }).filter(x => !x[1]).map(x => s.id + ': ' + x[0]); })"""
    for p in (page, gpt2_report[0]):
        browser.open(p)
        assert browser.eval(check) == [], p.name
    browser.open(page)
    assert "10M" in browser.eval("document.querySelector('svg.chart').textContent")
