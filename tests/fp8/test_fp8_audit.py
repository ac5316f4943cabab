"""`--formats fp8_e4m3` wired into the audit (precision_audit/fp8/audit.py, the hook in audit.py): audit.json's
fp8 section and policy.json's fp8 key on the planted sample; FP8 alone is accepted; without it nothing changes
(tests/e2e/test_golden_audit.py keeps the default audit.json identical)."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT
from precision_audit.audit import AuditOptions, run_audit
from precision_audit.record.schemas import validate_audit

MODEL = str(ROOT / "sample_models" / "fp8_outliers" / "model.py")


@pytest.fixture(scope="module")
def fp8_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8")
    run_audit(AuditOptions(model=MODEL, out=out, formats="fp8_e4m3", target="h100", steps=0))
    return out


@pytest.fixture(scope="module")
def fp8_only(fp8_out):
    return json.loads((fp8_out / "audit.json").read_text()), json.loads((fp8_out / "policy.json").read_text())


def test_fp8_section_in_audit_json(fp8_only):
    audit, policy = fp8_only
    validate_audit(audit)
    assert audit["formats"] == []
    assert audit["formats_skipped"] == [{"format": "fp8_e4m3", "reason": "measured per recipe in the fp8 section, "
                                         "not as an autocast pass (docs/fp8.md)"}]
    f = audit["fp8"]
    assert [L["name"] for L in f["layers"]] == ["tokens", "channels", "head"]
    tok = f["layers"][0]["recipes"]
    assert not tok["fp8_tensorwise"]["meets_budget"] and tok["fp8_rowwise"]["meets_budget"]
    ch = f["layers"][1]["recipes"]
    assert not ch["fp8_rowwise"]["meets_budget"] and ch["mxfp8"]["meets_budget"]
    assert f["target"]["recipes_supported"] == ["fp8_tensorwise", "fp8_delayed", "fp8_rowwise", "fp8_rowwise_gw_hp"]
    # 256-wide layers on 128 tokens: nothing pays on an H100, and the plan says so per module
    assert f["plan"]["fp8_flop_share"] == 0.0
    assert "not worth converting" in f["plan"]["modules"]["head"]["reason"]
    assert f["torchao_auto_filter"]["head"] == {"fp8_tensorwise": False, "fp8_rowwise": False}
    assert policy["fp8"] == {"modules": {}}


def test_report_fp8_section(fp8_only):
    from precision_audit.record.codec import from_json
    from precision_audit.report.html import render_html
    audit, policy = fp8_only
    html = render_html(from_json(audit), policy)
    sec = html[html.index('<section id="fp8"'):]
    sec = sec[:sec.index("</section>")]
    assert "Planned FP8 share of the linear layers' GEMM FLOPs: 0%" in sec
    row = sec[sec.index(">channels<"):]
    row = row[:row.index("</tr>")]
    # tensorwise and rowwise fail the outlier-channel layer, MXFP8 meets the budget there
    cells = row.split("<td ")[2:8]
    assert [("ok" in c.split(">")[0]) for c in cells] == [False, False, False, False, True, False]
    no_fp8 = {k: v for k, v in audit.items() if k != "fp8"}
    assert 'id="fp8"' not in render_html(from_json(no_fp8), policy)
    broken = dict(audit, fp8={"layers": [{"name": 1, "recipes": 5}], "recipes": {"x": {}}})
    assert 'id="fp8"' not in render_html(from_json(broken), policy)  # a hand-edited section is left out, not a crash


def test_the_fp8_stage_puts_every_cuda_generator_back():
    """The stage reseeds for every measurement (torch.manual_seed, which reseeds every CUDA device too) and forked
    only the CPU generator: after an audit on a GPU, the user's CUDA generator was at the audit's seed."""
    import torch
    from torch import nn

    from fakecuda import FakeCuda
    from precision_audit.analysis.findings import Budget
    from precision_audit.fp8.audit import fp8_stage
    from precision_audit.gpus import resolve_target

    with FakeCuda(device_count=2):
        torch.manual_seed(5)
        model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)).to("cuda")
        x = torch.randn(16, 32, device="cuda")
        torch.cuda.manual_seed_all(123)
        torch.cuda.set_rng_state(torch.tensor([7, 40], dtype=torch.int64).view(torch.uint8), 1)
        before = torch.cuda.get_rng_state_all()
        cpu_before = torch.get_rng_state()
        fp8_stage(model, lambda m: m(x), lambda out: out.float().pow(2).mean(), resolve_target("h100"), Budget(),
                  device="cuda", seed=0)
        after = torch.cuda.get_rng_state_all()
        assert all(torch.equal(a, b) for a, b in zip(before, after)), "a CUDA generator was left reseeded"
        assert torch.equal(torch.get_rng_state(), cpu_before)


def test_a_saved_fp8_audit_renders_again_and_diffs(fp8_out, tmp_path, capsys):
    """``precision-audit report`` and ``diff`` read the saved audit.json back, its fp8 section typed: the page is
    the audit's own apart from its timestamp, and an audit compared with itself changed nothing."""
    import re

    from precision_audit.cli.diff import diff_main
    from precision_audit.cli.report import report_main

    (tmp_path / "policy.json").write_text((fp8_out / "policy.json").read_text())
    assert report_main([str(fp8_out / "audit.json"), "--out", str(tmp_path), "--quiet"]) == 0
    stamp = re.compile(r'<time id="generated"[^>]*>[^<]*</time>')
    again = (tmp_path / "report.html").read_text()
    assert stamp.sub("", again) == stamp.sub("", (fp8_out / "report.html").read_text())
    assert '<section id="fp8"' in again and ">channels<" in again
    capsys.readouterr()
    assert diff_main([str(fp8_out), str(fp8_out / "audit.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["changed"] == []
