"""Hostile contexts for ``precision_audit.audit(model, batch)`` (issue 32, "Live contexts"; part of the hostile
catalogue with tests/cli/test_hostile_*.py and tests/policy/test_hostile_export.py).

The public API runs inside the user's own process and context, so what a script or notebook has switched on around
the call must neither change the figures nor be left changed:

- inside the caller's ``torch.autocast`` (or ``no_grad`` / ``inference_mode``) the FP32 reference is still FP32:
  the figures equal the audit's outside any context, bit for bit, and the caller's autocast, grad mode and TF32
  switches are as they were after the call, also when it raises;
- a second audit of a model while one runs (another thread) is refused with one clear error, and the running one's
  figures and the model's hooks are as without it;
- an ``out`` holding a NUL character, and a batch nested 1000 deep (or holding itself), are refused before the
  audit runs, with an AuditError.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import precision_audit
from precision_audit.errors import AuditError, BatchError, ModelInUseError, OptionError
from precision_audit.tf32_switches import snapshot as tf32_snapshot


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 64, generator=g), torch.randint(0, 64, (8,), generator=g)


def _figures(result) -> dict:
    s = result.audit["summary"]
    return {f: (s[f]["loss"], s[f].get("output", {}).get("rel_l2"), s[f].get("output", {}).get("elements"))
            for f in s}


@pytest.fixture(scope="module")
def plain() -> dict:
    """The figures of the audit called outside any context: the reference every context must reproduce."""
    return _figures(precision_audit.audit(_model(), _batch(), steps=0, progress=False))


def _context_state() -> tuple:
    return (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(), tf32_snapshot())


@pytest.mark.parametrize("context", [
    lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    lambda: torch.autocast("cpu", dtype=torch.float16),
    torch.no_grad,
    torch.inference_mode,
], ids=["autocast-bf16", "autocast-fp16", "no-grad", "inference-mode"])
def test_figures_inside_the_callers_context_equal_the_plain_audit(plain, context):
    """Without the guard, inside autocast(bf16) the FP32 loss came out bf16-rounded (4.23046875 instead of
    4.2292223) and the bf16 output error 0.0; under no_grad the audit could not differentiate the loss."""
    model = _model()  # built outside: parameters made under inference_mode could not be trained at all
    with context():
        inside = _context_state()
        result = precision_audit.audit(model, _batch(), steps=0, progress=False)
        assert _context_state() == inside, "the caller's context changed"
    assert _figures(result) == plain
    assert plain["bf16"][1] > 1e-3  # the bf16 output error is real: an FP32 reference in bf16 would make it 0


def test_the_callers_tf32_and_autocast_are_back_after_a_failing_audit():
    """The TF32 switches as the caller set them ("medium", not just a boolean), and its autocast, after an audit
    whose model changes the switches and raises."""

    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            torch.set_float32_matmul_precision("highest")  # the model changes the switches, then fails
            raise ValueError("the model's own error")

    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            before = _context_state()
            with pytest.raises(AuditError, match="the model's own error"):
                precision_audit.audit(Fails(), torch.randn(4, 8), steps=0, progress=False)
            assert _context_state() == before
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(saved)


class _Gated(nn.Module):
    """Its first forward waits until the test lets it go: a second audit is attempted meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(64, 128), nn.Linear(128, 64)
        self.started, self.go = threading.Event(), threading.Event()

    def forward(self, x):
        if not self.started.is_set():
            self.started.set()
            assert self.go.wait(60), "the test never let the first audit go on"
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _gated_released() -> _Gated:
    m = _Gated()
    m.started.set()
    return m


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               + len(getattr(m, "_backward_pre_hooks", {})) for m in model.modules())


def test_a_second_audit_of_a_model_being_audited_is_refused():
    """Two threads on one model: the second call raises ModelInUseError at once (naming the first's thread);
    the first returns the figures of an audit alone, and no hook is left. Without the refusal the two audits'
    hooks and swapped forwards interleaved: bf16 output elements 512 -> 0 and a hook left on the model."""
    alone = _figures(precision_audit.audit(_gated_released(), _batch(), steps=0, progress=False))
    model = _Gated()
    results: dict = {}

    def first() -> None:
        try:
            results["first"] = precision_audit.audit(model, _batch(), steps=0, progress=False)
        except BaseException as e:  # reported by the assertion below
            results["first"] = e

    t = threading.Thread(target=first, name="first-audit")
    t.start()
    try:
        assert model.started.wait(60)
        with pytest.raises(ModelInUseError, match="being audited already") as refused:
            precision_audit.audit(model, _batch(), steps=0, progress=False)
        assert "first-audit" in str(refused.value)
        with pytest.raises(ModelInUseError):  # a module inside it is in use too
            precision_audit.audit(model.fc1, torch.randn(4, 64), steps=0, progress=False)
    finally:
        model.go.set()
        t.join(120)
    assert not isinstance(results["first"], BaseException), results["first"]
    assert _figures(results["first"]) == alone
    assert _hooks(model) == 0
    # once it is done, the model can be audited again
    assert _figures(precision_audit.audit(model, _batch(), steps=0, progress=False)) == alone


def test_out_with_a_nul_character_is_refused_before_the_run():
    ran = []
    model = nn.Linear(8, 4)
    model.register_forward_hook(lambda *a: ran.append(1))
    with pytest.raises(OptionError, match="NUL"):
        precision_audit.audit(model, torch.randn(4, 8), out="x\0y", steps=0, progress=False)
    assert ran == [], "refused after the audit ran (the ValueError came from saving)"


def _deep(depth: int):
    b: object = torch.randn(4, 8)
    for _ in range(depth):
        b = [b]
    return b


def _holds_itself():
    b: list = [torch.randn(4, 8)]
    b.append(b)
    return b


@pytest.mark.parametrize("batch", [lambda: _deep(1000), _holds_itself, lambda: {"x": _deep(100)}],
                         ids=["nested-1000", "holds-itself", "dict-nested-100"])
def test_a_batch_nested_too_deep_is_a_batch_error(batch):
    with pytest.raises(BatchError, match="nests containers more than 64 deep"):
        precision_audit.audit(nn.Linear(8, 4), batch(), steps=0, progress=False)


def test_a_batch_nested_64_deep_is_accepted():
    from precision_audit.loading.nested import MAX_DEPTH, check_nesting

    check_nesting(_deep(MAX_DEPTH), "b")
    with pytest.raises(BatchError):
        check_nesting(_deep(MAX_DEPTH + 1), "b")
