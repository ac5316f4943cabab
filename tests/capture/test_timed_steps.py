"""The timed steps (capture/timing.py; docs/gpu.md, "Timed steps"): clean steps timed with CUDA events and run as the
user compiled them, per-module times from instrumented steps without the profiler, and a profiler only when traces
are asked for, started once for every format (issue 31, "The audit's GPU time" and item 7)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import precision_audit
from fakecuda import fake_cuda  # noqa: F401 - the fixture
from precision_audit.capture.runner import CaptureConfig, CaptureSession
from precision_audit.formats import Format


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _count_profiler_starts(monkeypatch) -> list[int]:
    starts = [0]
    real = torch.profiler.profile.start

    def start(self):
        starts[0] += 1
        return real(self)

    monkeypatch.setattr(torch.profiler.profile, "start", start)
    return starts


def test_no_profiler_without_trace_and_tb_says_why(tmp_path, monkeypatch):
    """On main every format's timed steps ran under torch.profiler (its start-up took 0.7-6.9 s per format on an
    H200); by default none does now, and audit.json and tb/ say that no trace was taken, and how to get one."""
    starts = _count_profiler_starts(monkeypatch)
    torch.manual_seed(0)
    r = precision_audit.audit(_Tiny(), torch.randn(4, 8), steps=2, formats="fp16,bf16", progress=False,
                              out=tmp_path / "a")
    a = r.audit
    assert starts[0] == 0, "the profiler started without --trace"
    assert a["traces"]["files"] == []
    note = a["traces"]["note"]
    assert note.startswith("no profiler trace taken: the timed steps were timed with the wall clock") and \
        "--trace" in note, note
    assert (tmp_path / "a" / "tb" / "NO_PROFILER_TRACE.txt").read_text() == f"No profiler trace in this audit: {note}\n"
    for fmt in ("fp32", "fp16", "bf16"):  # the step times and the per-module times are measured all the same
        assert a["summary"][fmt]["step_time"]["measured_s"] > 0, fmt
        fc1 = next(L for L in a["layers"] if L["name"] == "fc1")
        assert fc1["cost"]["measured_forward_time_s"][fmt] > 0, fmt


def test_trace_starts_one_profiler_for_every_format_and_replaces_the_no_trace_note(tmp_path, monkeypatch):
    torch.manual_seed(0)
    precision_audit.audit(_Tiny(), torch.randn(4, 8), steps=1, formats="bf16", progress=False, out=tmp_path / "a")
    assert (tmp_path / "a" / "tb" / "NO_PROFILER_TRACE.txt").is_file()
    starts = _count_profiler_starts(monkeypatch)
    r = precision_audit.audit(_Tiny(), torch.randn(4, 8), steps=2, formats="fp16,bf16", progress=False,
                              out=tmp_path / "a", trace=True)
    assert starts[0] == 1, f"{starts[0]} profiler start-ups for 3 formats"
    files = r.audit["traces"]["files"]
    assert sorted({f.split("/")[1] for f in files}) == ["bf16", "fp16", "fp32"], files
    for f in files:  # each format's trace holds its own profiled steps, with the module markers
        trace = json.loads((tmp_path / "a" / f).read_text())
        steps = [e for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")]
        assert len(steps) == 2, (f, [e["name"] for e in steps])
        assert any(e.get("name") == "module::fc1" for e in trace["traceEvents"]), f
    assert not (tmp_path / "a" / "tb" / "NO_PROFILER_TRACE.txt").exists(), "the earlier audit's note is replaced"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_compiled_submodules_clean_steps_run_compiled_on_cuda(fake_cuda):
    """Issue 31 item 7: the session runs under set_stance("force_eager") for its hooks and statistics, and so did the
    timed steps: a compiled model's measured step was its eager one. The clean steps now run the compiled code."""
    torch._dynamo.reset()
    runs = [0]

    def counting_backend(gm, example_inputs):
        def compiled(*args):
            runs[0] += 1
            return gm.forward(*args)
        return compiled

    model = _Tiny()
    model.fc1 = torch.compile(model.fc1, backend=counting_backend)
    x = torch.randn(4, 8, device="cuda")
    # TF32 (no autocast): the fake device routes CUDA autocast to the CPU emulation, which Dynamo does not trace
    cfg = CaptureConfig(formats=(Format.TF32,), device="cuda", mode="cuda")
    with CaptureSession(model, lambda m: m(x), lambda y: y.float().pow(2).mean(), cfg) as s:
        s.reference_run()
        assert s.format_run(Format.TF32).error is None
        assert runs[0] == 0, "the passes run the compiled submodule eagerly (the hooks see its ops)"
        s.timed_steps(2)
        assert not s.warnings, s.warnings
    assert runs[0] == 2 * 3, f"{runs[0]} compiled forwards: the warm-up and 2 timed steps, fp32 and tf32"
    torch._dynamo.reset()


def test_the_command_line_takes_trace_and_documents_it():
    from precision_audit.cli.audit import _audit_parser

    p = _audit_parser()
    assert p.parse_args(["m.py", "--trace"]).trace is True and p.parse_args(["m.py"]).trace is False
    assert "--trace" in p.format_help()
