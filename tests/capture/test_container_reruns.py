"""Local re-runs only for modules that compute something themselves; timed steps off by default when emulated.

A container whose own work (ops outside its children, seen by the FP32 pass's op tracker) is additions only —
a residual block — is not re-run alone per format (docs/memory.md, "Local re-runs"): its record says so in
``local_note`` instead of a missing value. A container that computes something else itself (a scaling, a
concatenation) is still re-run.
"""

from __future__ import annotations

import torch
from torch import nn

from precision_audit.audit import AuditOptions, resolve_steps
from precision_audit.capture import CONTAINER_NOTE, CaptureConfig, CaptureSession
from precision_audit.cli import _audit_parser
from precision_audit.formats import Format


class Residual(nn.Module):  # own work: one addition (and a view)
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x))).view(x.shape)


class FunctionalResidual(Residual):  # torch.relu in its own forward: work of its own, re-run
    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Scaled(nn.Module):  # own work: a multiplication and an addition
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + 0.5 * self.fc(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.res = Residual()
        self.fres = FunctionalResidual()
        self.seq = nn.Sequential(nn.Linear(16, 16), nn.GELU())  # no work of its own at all
        self.scaled = Scaled()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.scaled(self.seq(self.fres(self.res(x)))))


def capture(monkeypatch):
    reruns: list[str] = []
    real = CaptureSession._rerun_once

    def spy(self, m, fmt, *a, **k):
        reruns.append(self._names[id(m)])
        return real(self, m, fmt, *a, **k)

    monkeypatch.setattr(CaptureSession, "_rerun_once", spy)
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 16)
    with CaptureSession(model, lambda m: m(x), lambda y: y.pow(2).mean(),
                        CaptureConfig((Format.FP16, Format.BF16))) as s:
        s.reference_run()
        for f in s.config.formats:
            s.format_run(f)
        layers = {r.name: r for r in s.result().layers}
    return layers, reruns


def test_a_residual_container_is_not_rerun_and_says_so(monkeypatch):
    layers, reruns = capture(monkeypatch)
    assert "res" not in reruns, "a container whose own work is a residual add must not be re-run"
    for f in (Format.FP16, Format.BF16):
        fs = layers["res"].formats[f]
        assert fs.local is None and fs.local_note == CONTAINER_NOTE
        assert "not re-run: container" in fs.local_note
        # its children are measured, and its accumulated error still is
        assert layers["res.fc1"].formats[f].local is not None and layers["res.fc2"].formats[f].local is not None
        assert fs.accumulated.n == 8 * 16
    assert layers["res"].computes, "an addition is still work of its own (reported as computing)"


def test_a_container_with_other_work_of_its_own_is_still_rerun(monkeypatch):
    layers, reruns = capture(monkeypatch)
    assert reruns.count("scaled") == 2, "one re-run per format: its own multiplication is work"
    assert reruns.count("fres") == 2, "one re-run per format: its own relu is work"
    assert layers["scaled"].formats[Format.BF16].local is not None
    assert "seq" not in reruns and layers["seq"].formats[Format.BF16].local_note.startswith("a container")
    # leaves that compute are re-run once per format; res.fc1, called on the batch itself, is measured from the
    # format passes instead (tests/capture/test_batch_calls.py)
    for name in ("res.fc2", "res.act", "seq.0", "seq.1", "scaled.fc", "head"):
        assert reruns.count(name) == 2, name
    assert "res.fc1" not in reruns and layers["res.fc1"].formats[Format.BF16].local is not None


def test_timed_steps_default_off_in_emulated_mode_and_on_in_cuda_mode():
    assert resolve_steps(None, "emulated") == 0
    assert resolve_steps(None, "cuda") == 1
    assert resolve_steps(3, "emulated") == 3 and resolve_steps(0, "cuda") == 0
    assert AuditOptions(model="m.py").steps is None
    assert _audit_parser().parse_args(["m.py"]).steps is None


def test_default_emulated_audit_has_no_timed_steps_and_records_zero(sample_audits):
    a = sample_audits.audit_json("mlp")
    assert a["options"]["steps"] == 0
    assert a["traces"]["files"] == []
    assert all(s["step_time"].get("measured_s") is None for s in a["summary"].values())
