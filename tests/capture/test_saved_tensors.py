"""The tensors a pass saves for backward are let go when the pass is over (capture/memory.py, _Saved): a graph no
backward frees — the loss function's trial call, outputs the loss does not use — made a cycle through autograd's
C++ objects with the counter's saved-tensor hooks, and nothing of the audit was ever freed."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

import precision_audit as pa
from precision_audit.capture.memory import SavedTensorCounter
from precision_audit.capture.session import CaptureSession


def test_a_graph_never_run_backward_is_freed_once_its_saved_tensors_are_let_go():
    x = torch.randn(64, 8, requires_grad=True)
    counter = SavedTensorCounter(nn.Linear(1, 1), lambda: None)
    with counter:
        y = torch.softmax(x * 2, dim=1)  # softmax saves its own output
    out = weakref.ref(y)
    del y
    gc.collect()
    assert out() is not None, "the cycle this guards against: the output, its node and the saved output"
    counter.release_saved()
    gc.collect()
    assert out() is None


def test_a_pass_still_runs_its_backward_and_checks_versions():
    x = torch.randn(16, 8, requires_grad=True)
    counter = SavedTensorCounter(nn.Linear(1, 1), lambda: None)
    with counter:
        loss = torch.tanh(x).pow(2).sum()
    loss.backward()
    assert x.grad is not None and torch.allclose(x.grad, 2 * torch.tanh(x) * (1 - torch.tanh(x) ** 2))
    counter.release_saved()


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 5)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_nothing_of_an_audit_outlives_it(monkeypatch):
    """A cross-entropy loss: its log_softmax saves its own output (the logits' size), so the trial call that
    resolves the loss kept that tensor, the session and every record alive after audit() returned."""
    sessions: list[weakref.ref] = []
    real_init = CaptureSession.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        sessions.append(weakref.ref(self))
    monkeypatch.setattr(CaptureSession, "__init__", init)
    saved: list[weakref.ref] = []
    real_pack = SavedTensorCounter._pack

    def pack(self, t):
        saved.append(weakref.ref(t))
        return real_pack(self, t)
    monkeypatch.setattr(SavedTensorCounter, "_pack", pack)
    torch.manual_seed(0)
    model = Mlp()
    batch = (torch.randn(8, 16), torch.randint(0, 5, (8,)))
    result = pa.audit(model, batch, loss_fn=lambda out, b: nn.functional.cross_entropy(out, b[1]), steps=0,
                      formats="bf16", progress=False)
    assert result.audit["summary"]["bf16"]["output"]["rel_l2"] > 0
    del result
    gc.collect()
    assert sessions and not [w for w in sessions if w() is not None], "a capture session outlived the audit"
    left = [tuple(t.shape) for w in saved if (t := w()) is not None and t.grad_fn is not None]
    assert saved and not left, f"tensors saved for backward in the audit's passes outlived it: {left}"


_WIDE_HEAD = '''
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2000))


def sample_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 16, generator=g), torch.randint(0, 2000, (64,), generator=g)
'''


def test_the_loss_functions_trial_call_builds_no_graph(tmp_path):
    """The audit resolves the loss with one trial call of the file's loss_fn on the FP32 pass's output (audit.py,
    SubjectRun). Under autograd that call built a second loss graph inside the pass: a logits-sized log_softmax
    held to the pass's peak and counted as the pass's saved activations (audit.json memory.per_format.fp32), where
    the same loss inferred from the target (no trial call) counts one."""
    from precision_audit.audit import AuditOptions, compute_audit

    inferred = tmp_path / "inferred.py"
    inferred.write_text(_WIDE_HEAD)
    own = tmp_path / "own.py"
    own.write_text(_WIDE_HEAD + "\n\ndef loss_fn(out, batch):\n    grad_modes.append(torch.is_grad_enabled())\n"
                                "    return nn.functional.cross_entropy(out, batch[1])\n\n\ngrad_modes = []\n")

    def saved(path) -> int:
        a = compute_audit(AuditOptions(model=str(path), steps=0, formats=("bf16",))).audit
        return a["memory"]["per_format"]["fp32"]["saved_activation_bytes"]

    assert saved(own) == saved(inferred)
    import sys

    module = next(m for n, m in sys.modules.items() if n.startswith("_precision_audit_user_model_")
                  and getattr(m, "__file__", "") == str(own.resolve()))
    assert module.grad_modes[0] is False, "the trial call ran with autograd recording"
