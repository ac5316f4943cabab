"""``precision-audit report FOLDER`` (issue 36): the timeline page of a run, from a folder of audits
(``step-<N>/audit.json``) and a watch log, self-contained, and fitting 1280 px in headless Chromium (skipped, saying
so, without /usr/bin/chromium). The 20-audit, 100-layer acceptance case is marked slow (~30 s of audits)."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import precision_audit as pa
from precision_audit.cli import main

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_report_browser import CHROMIUM, Chromium  # noqa: E402

sys.path.pop(0)


def _deep(n_pairs: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(n_pairs):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers)


def _audits(root: Path, n_pairs: int, n_audits: int) -> Path:
    """``n_audits`` real audits of a ``2 x n_pairs``-layer model, 10 SGD steps apart (targets growing 1.5x per
    audit, so the model's last layers grow), into root/step-<N>/."""
    model = _deep(n_pairs)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for k in range(n_audits):
        pa.audit(model, (x, y), out=root / f"step-{(k + 1) * 10}", steps=0, progress=False, formats="fp16,bf16")
        for _ in range(10):
            opt.zero_grad()
            F.mse_loss(model(x), y * 1.5 ** k).backward()
            opt.step()
    return root


def _watch_log(path: Path) -> Path:
    from tests.runtime.test_runtime_watch import _train

    ctl, _, _ = _train("fp16", 160, 1.08, watch=True, adaptive=True, watch_every=2, horizon=50)
    ctl.save_watch(path)
    return path


def _check_page(page: Path, audits: list[dict], tmp_path: Path) -> None:
    text = page.read_text()
    assert "<script" not in text and not re.search(r'(src|href)="?(https?:|//|file:)', text), "self-contained"
    cells = re.findall(r"<title>([^<]*) at step (\d+), (\w+): ([^<]*)</title>", text)
    layers = [layer for layer in audits[0]["layers"] if layer["activation"].get("headroom_bits")]
    formats = list(layers[0]["activation"]["headroom_bits"])
    assert len(cells) == len(layers) * len(audits) * len(formats)
    # a cell shows what its audit.json holds (read independently here)
    name, step, fmt, val = cells[-1]
    want = next(layer for layer in audits[-1]["layers"] if (layer["name"] or "(root)") == name)
    assert val == f"{want['activation']['headroom_bits'][fmt]:+.1f} bits"
    if not Path(CHROMIUM).exists():
        pytest.skip("no /usr/bin/chromium: the page's layout is not checked here")
    browser = Chromium(tmp_path / "profile")
    try:
        browser.open(page)
        assert browser.errors() == []
        width = browser.eval("document.documentElement.scrollWidth")
        assert width <= 1280, f"the page is {width} px wide at a 1280 px window"
        assert browser.eval("document.querySelectorAll('svg.heat rect').length") == len(cells)
    finally:
        browser.close()


def test_timeline_of_audits_and_a_watch_log(tmp_path, capsys):
    root = _audits(tmp_path / "run", 10, 3)
    _watch_log(root / "watch.json")
    assert main(["report", str(root)]) == 0
    page = root / "timeline.html"
    assert capsys.readouterr().out.strip() == f"wrote {page}"
    text = page.read_text()
    assert "fp16 -&gt; bf16" in text and "forecast to pass fp16&#x27;s largest value 65504" in text
    assert re.search(r"<td>head</td><td>fp16</td><td>activation</td>", text), "the head's forecast is listed"
    audits = [json.loads((root / f"step-{s}" / "audit.json").read_text()) for s in (10, 20, 30)]
    _check_page(page, audits, tmp_path)


def test_a_watch_log_alone_and_bad_input(tmp_path, capsys):
    log = _watch_log(tmp_path / "w" / "run.watch.json")
    assert main(["report", str(log), "--out", str(tmp_path / "o")]) == 0
    assert "Output amax per module" in (tmp_path / "o" / "timeline.html").read_text()
    (tmp_path / "empty").mkdir()
    (tmp_path / "badwatch").mkdir()
    (tmp_path / "badwatch" / "watch.json").write_text('{"schema": "precision-audit/policy"}')
    for target, words in ((tmp_path / "empty", "holds no audit.json"), (tmp_path / "badwatch", "is not a watch log")):
        capsys.readouterr()
        assert main(["report", str(target)]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err
    assert not (tmp_path / "empty" / "timeline.html").exists()


@pytest.mark.slow
def test_twenty_audits_of_a_100_layer_model_fit_1280_px(tmp_path):
    root = _audits(tmp_path / "run", 50, 20)
    assert main(["report", str(root)]) == 0
    audits = [json.loads((root / f"step-{s}" / "audit.json").read_text()) for s in range(10, 210, 10)]
    assert len(audits[0]["layers"]) == 101
    _check_page(root / "timeline.html", audits, tmp_path)
    shutil.rmtree(root / "step-10")
