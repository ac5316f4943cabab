"""Issue 14, P1: the reference pass's repeat at the second reduction order reads its impacts only, and the bf16
diff of a local re-run takes one subtraction where the reference is finite — both without changing a figure."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import ROOT
from precision_audit.audit import SubjectRun, load_subject, set_up
from precision_audit.capture import op_tracker, reference_pass
from precision_audit.capture.noise import second_order_impacts
from precision_audit.capture.ranks import Ranks
from precision_audit.capture.reference_pass import _diff_bf16
from precision_audit.capture.session import CaptureConfig, CaptureSession
from precision_audit.capture.session_state import PassState
from precision_audit.options import AuditOptions


def _masked(y: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The diff as it was computed before: exact reference for _diff_bf16."""
    return torch.where(torch.isfinite(y), p.float() - y, 0.0).to(torch.bfloat16)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("pdtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_diff_bf16_equals_the_masked_diff(pdtype):
    g = torch.Generator().manual_seed(1)
    y = torch.randn(4097, generator=g) * torch.logspace(-30, 30, 4097)
    p = (y * (1 + 1e-3 * torch.randn(4097, generator=g))).to(pdtype)
    for finite in (None, True):
        assert _same_bits(_diff_bf16(y, p, finite), _masked(y, p))
    # non-finite reference values (FP32's own): zero there, by the masked path (flag False or found by the sum)
    y_bad = y.clone()
    y_bad[[3, 50, 4000]] = torch.tensor([math.inf, -math.inf, math.nan])
    for finite in (None, False):
        assert _same_bits(_diff_bf16(y_bad, p, finite), _masked(y_bad, p))
    # a non-finite low-precision value where FP32 is finite is kept (it is the format's)
    p_bad = p.clone()
    p_bad[7] = math.inf
    assert _same_bits(_diff_bf16(y, p_bad, None), _masked(y, p_bad))
    assert torch.isinf(_diff_bf16(y, p_bad, None)[7])


def test_diff_bf16_with_an_overflowing_sum_is_still_exact():
    y = torch.full((8,), 3.0e38)  # every element finite, their sum is not: the masked path, same bits
    p = y.clone().to(torch.bfloat16)
    assert not math.isfinite(float(y.sum()))
    assert _same_bits(_diff_bf16(y, p, None), _masked(y, p))


class _Before(PassState):
    """The repeat records everything as the first pass does (the flag cannot be set)."""

    impacts_only = property(lambda self: False, lambda self, value: None)  # type: ignore[assignment]


@pytest.mark.parametrize("sample", ["tiny_gpt", "cnn"])
def test_second_order_impacts_equal_the_full_repeat_and_skip_the_tracker(sample, monkeypatch):
    opts = AuditOptions(model=str(ROOT / "sample_models" / sample / "model.py"))
    subject = load_subject(opts)
    setup = set_up(opts)
    run = SubjectRun(subject.source, subject.batch, setup.device)
    config = CaptureConfig(formats=setup.formats, device=setup.device, mode=setup.mode, seed=0, timed_steps=0,
                           kernels=setup.kernels)
    trackers = []
    real = op_tracker.OpTracker.__init__

    def counting(self, calls, model):
        trackers.append(calls)
        real(self, calls, model)

    monkeypatch.setattr(op_tracker.OpTracker, "__init__", counting)
    with CaptureSession(subject.model, run.forward, run.loss_of, config) as s:
        s.reference_run()
        first = {r.name: (r.activation.counts.tolist(), r.calls) for r in s.layers.values()}
        lean, note = second_order_impacts(s, 2)
        assert note is None and lean
        assert len(trackers) == 1  # the first pass's tracker only: the repeat reads its counts
        assert {r.name: (r.activation.counts.tolist(), r.calls) for r in s.layers.values()} == first
        s.state.__class__ = _Before
        full, _ = second_order_impacts(s, 2)
        s.state.__class__ = PassState
    assert len(trackers) == 2
    assert lean == full  # exactly: same impacts per module and format, the same modules measured
    assert any(v is not None and v > 0 for per in lean.values() for v in per.values())


def test_the_flag_is_off_after_the_repeat_even_when_it_fails(monkeypatch):
    opts = AuditOptions(model=str(ROOT / "sample_models" / "mlp" / "model.py"))
    subject = load_subject(opts)
    setup = set_up(opts)
    run = SubjectRun(subject.source, subject.batch, setup.device)
    config = CaptureConfig(formats=setup.formats, device=setup.device, mode=setup.mode, timed_steps=0,
                           kernels=setup.kernels)
    with CaptureSession(subject.model, run.forward, run.loss_of, config) as s:
        s.reference_run()

        def boom(*a, **k):
            raise RuntimeError("boom")

        monkeypatch.setattr(reference_pass.ReferencePass, "_local_rerun", boom)
        impacts, note = second_order_impacts(s, 2)
        assert impacts is None and "boom" in note
        assert s.state.impacts_only is False


class _Wide(torch.nn.Module):
    """GEMMs with a long reduction (K = 4096), whose FP32 sums split differently at 1 and 2 threads, and dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 4096), torch.nn.Linear(4096, 64)
        self.drop, self.head = torch.nn.Dropout(0.1), torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.head(self.drop(torch.relu(self.down(torch.relu(self.up(x))))))


def test_the_noise_floors_fp32_forward_is_the_repeats_own(monkeypatch):
    """The FP32 forward at the second order is read from the repeated reference pass (its forward is that forward):
    the same noise floor as a forward of its own, which no longer runs."""
    from precision_audit.capture import noise
    from precision_audit.capture.noise import measure_noise_floor
    from precision_audit.formats import Format

    runs: list[bool] = []
    real_run = noise._Fp32Order.run

    def counting(self):
        runs.append(True)
        real_run(self)

    monkeypatch.setattr(noise._Fp32Order, "run", counting)

    def floor(separate: bool):
        torch.manual_seed(0)
        model, x = _Wide(), torch.randn(16, 64)
        real = noise.second_order_impacts
        if separate:  # the repeat is not asked for the FP32 forward: the noise floor runs its own
            monkeypatch.setattr(noise, "second_order_impacts", lambda s, t, fp32=None: real(s, t))
        try:
            with CaptureSession(model, lambda m: m(x), lambda y: y.pow(2).mean(),
                                CaptureConfig((Format.FP16, Format.BF16))) as s:
                s.reference_run()
                for f in s.config.formats:
                    s.format_run(f)
                nf = measure_noise_floor(s, s.config.formats)
                # kept as the references are (a file on a CPU): read back while the session is open
                outputs = [s.state.refs.on(o, x).tolist() for o in nf.outputs or []]
        finally:
            monkeypatch.setattr(noise, "second_order_impacts", real)
        return (nf.reference_loss, nf.loss_rel, nf.output_rel_error, nf.layers,
                {f: (r.loss, r.output_rel_error) for f, r in nf.runs.items()}, nf.impacts, outputs)

    assert floor(False) == floor(True)
    assert runs == [True], "the merged path ran no FP32 forward of its own; the separate one ran one"


_REENTRANT = torch.utils.checkpoint.CheckpointFunction


class _Awkward(torch.nn.Module):
    """Outputs a later op changes in place, an output the loss never uses, a tied weight, and (optionally) a
    reentrant activation checkpoint, which supports backward() only."""

    def __init__(self, reentrant: bool = False, view: bool = False) -> None:
        super().__init__()
        self.emb, self.fc, self.side = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight
        self.reentrant, self.view = reentrant, view

    def forward(self, ids):
        h = self.emb(ids)
        # fc's output, changed after its hook saw it: on a 3-D input a view of fc's 2-D product (its hook moves to
        # that product's node: capture/output_grads.py), on a 2-D one the product itself
        y = self.fc(h) if self.view else self.fc(h.reshape(-1, 16)).unflatten(0, ids.shape)
        y.mul_(0.5)
        self.side(h)  # unused by the loss
        if self.reentrant:
            # a reentrant segment of a library's own (DeepSpeed's, Megatron's), which the audit does not make
            # non-reentrant as it does torch.utils.checkpoint's (capture/checkpointing.py)
            y = _REENTRANT.apply(self.fc, True, torch.relu(y))
        return self.head(torch.tanh(y))


@pytest.mark.parametrize("reentrant,view", [(False, False), (True, False), (False, True)])
def test_the_second_orders_backward_asks_for_the_outputs_gradients_only(monkeypatch, reentrant, view):
    from precision_audit.formats import Format

    asked: list[int] = []
    real_grad = torch.autograd.grad

    def spy(outputs, inputs, *a, **k):
        asked.append(len(inputs))
        return real_grad(outputs, inputs, *a, **k)

    monkeypatch.setattr(torch.autograd, "grad", spy)

    def impacts(outputs_only: bool):
        monkeypatch.setattr(Ranks, "outputs_only_backward", outputs_only)
        torch.manual_seed(0)
        model, ids = _Awkward(reentrant, view), torch.randint(0, 32, (4, 8))
        with CaptureSession(model, lambda m: m(ids), lambda y: y.pow(2).mean(),
                            CaptureConfig((Format.FP16, Format.BF16))) as s:
            s.reference_run()
            got, note = second_order_impacts(s, 1)
            assert note is None
            return got

    lean, full = impacts(True), impacts(False)
    assert lean == full  # exactly
    assert all(lean[name][f] for name in ("head", "fc") for f in (Format.FP16, Format.BF16))
    # the whole backward where reentrant checkpointing or a view changed in place needs it (and always in the full
    # variant)
    whole = reentrant or view
    assert asked == ([] if whole else [asked[0]]) and (whole or asked[0] > 0)
