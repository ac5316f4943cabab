"""The terminal: progress per stage (bars on a TTY, plain lines otherwise, nothing when quiet) and the summary."""

from __future__ import annotations

import copy
import io
import json
import threading

from precision_audit.report.terminal import Progress, summary_text


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_when_not_a_tty():
    stream = io.StringIO()
    with Progress(stream=stream) as p:
        p("loading")
        with p.bar("fp16 layers", total=3) as b:
            b.update(3)
        p("fp16 pass")
    assert stream.getvalue() == "[1] loading\n[2] fp16 pass\n", "one line per stage, no bars"
    assert p.stages == ["loading", "fp16 pass"]


def test_quiet_prints_nothing():
    for stream in (io.StringIO(), FakeTTY()):
        with Progress(quiet=True, stream=stream) as p:
            p("loading")
            with p.bar("x", total=2) as b:
                b.update(1)
        assert stream.getvalue() == ""


def test_bars_per_stage_on_a_tty():
    stream = FakeTTY()
    with Progress(stream=stream, refresh_s=0.01) as p:
        p("loading the model")
        p("fp16 pass")
        with p.bar("fp16: layers", total=4) as b:
            for _ in range(4):
                b.update(1)
        p("bf16 pass")
    out = stream.getvalue()
    for stage in ("[1] loading the model", "[2] fp16 pass", "[3] bf16 pass", "fp16: layers"):
        assert stage in out
    assert out.count("✓") == 3, "each finished stage is marked done"
    assert not any(t.name == "precision-audit-progress" for t in threading.enumerate()), "the clock thread stops"


def test_summary_text_lists_every_format_and_the_plan(sample_audits):
    _, out, _ = sample_audits.get("fp16_trouble", target="v100")
    audit = json.loads((out / "audit.json").read_text())
    text = summary_text(audit)
    lines = text.splitlines()
    assert lines[0].startswith("precision-audit: FP16Trouble") and "V100" in lines[0]
    assert any(line.split()[:1] == ["fp32"] for line in lines) and any(line.split()[:1] == ["fp16"] for line in lines)
    assert any(line.strip().startswith("bf16") and "not a candidate" in line for line in lines)
    assert "plan:" in text and "fp16 loss scale" in text
    # this toy model is launch-bound on the target (every plan at the cost model's per-kernel floor), so uniform
    # fp32 is returned; an override in the plan is printed as one line
    audit["plan"]["overrides"] = {"hot": {"format": "fp32", "reason": "fp16 output reaches 1.97e+05 > 6.55e+04"}}
    assert "    hot -> fp32: fp16 output reaches 1.97e+05" in summary_text(audit)


def test_summary_shows_estimated_speedup_when_present(sample_audits):
    _, out, _ = sample_audits.get("mlp")
    audit = json.loads((out / "audit.json").read_text())
    a = copy.deepcopy(audit)
    a["summary"]["fp32"]["step_time"]["estimated_s"] = 4e-3
    a["summary"]["bf16"]["step_time"]["estimated_s"] = 1e-3
    a.pop("estimates", None)
    text = summary_text(a)
    assert "speedup" in text and "4.00x" in text and "1 ms" in text
    for f in a["summary"].values():
        f["step_time"]["estimated_s"] = None
        f["step_time"]["estimated_note"] = "not measured: no cost model"
    assert "not measured: no cost model" in summary_text(a)
