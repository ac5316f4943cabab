"""A parent's local re-run takes its children's re-run outputs instead of computing them again.

docs/memory.md, "Local re-runs": a child's re-run in a format runs before its parent's (its post-hook fires first);
where the parent's re-run calls it on the very tensors (same objects, same versions) the FP32 call had, with
nothing else changed, it gets the child's re-run outputs (capture/rerun_reuse.py). The counts below are worked out
by hand from the passes; the figures must be the same bits as with the reuse off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch
from torch import nn

from fakecuda import FakeCuda
from precision_audit.capture import CaptureConfig, CaptureSession
from precision_audit.capture.rerun_reuse import ChildReruns
from precision_audit.formats import Format

FORMATS = (Format.FP16, Format.BF16)


class Counting(nn.Linear):
    """A linear layer that counts the GEMMs it computes (its forward's runs)."""

    runs: list[str] = []

    def forward(self, x):
        Counting.runs.append(getattr(self, "label", "?"))
        return super().forward(x)


def linear(label: str, n_in: int = 16, n_out: int = 16) -> Counting:
    m = Counting(n_in, n_out)
    m.label = label
    return m


class Attention(nn.Module):  # computes beside its children (matmuls, softmax): re-run whole
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (linear(c) for c in "qkvo")

    def forward(self, x):
        a = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) / 4, dim=-1)
        return self.o(a @ self.v(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.attn, self.head = linear("inp"), Attention(), linear("head", 16, 4)

    def forward(self, x):  # inp's input is the batch: a call on the batch, measured by the format passes
        return self.head(torch.tanh(self.attn(self.inp(x))))


def run(model: nn.Module, x: torch.Tensor, reuse: bool, monkeypatch, cuda: bool = False) -> tuple[list, list[str]]:
    monkeypatch.setattr(ChildReruns, "enabled", reuse)
    Counting.runs = []
    config = CaptureConfig(FORMATS, device="cuda", mode="cuda") if cuda else CaptureConfig(FORMATS)
    with CaptureSession(model, lambda m: m(x), lambda y: y.pow(2).mean(), config) as s:
        s.reference_run()
        for f in FORMATS:
            s.format_run(f)
        layers = s.result().layers
    return layers, Counting.runs


def test_the_parents_rerun_takes_its_childrens_outputs(monkeypatch):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 8, 16)
    _, without = run(model, x, False, monkeypatch)
    _, with_reuse = run(model, x, True, monkeypatch)
    # FP32 pass: inp q k v o head (6); re-runs per format: q k v o alone (4), the attention whole (4 computed
    # without reuse, only o with it: q, k, v take the attention's input x), head (1); inp is on the batch (no
    # re-run); each format pass: 6
    assert len(without) == 6 + 2 * (4 + 4 + 1) + 2 * 6 == 36, without
    assert len(with_reuse) == 6 + 2 * (4 + 1 + 1) + 2 * 6 == 30, with_reuse
    assert sorted(without) == sorted(with_reuse + ["q", "k", "v"] * 2), "only q, k, v inside the attention's re-run"


def _figures(layers) -> list:
    """Every figure of every record, floats as their bits (NaN and -0.0 compare exactly)."""
    def bits(v):
        if isinstance(v, float):
            return ("f", math.copysign(1.0, v), v.hex()) if not math.isnan(v) else ("nan",)
        if isinstance(v, dict):
            return {str(k): bits(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [bits(x) for x in v]
        if isinstance(v, torch.Tensor):
            return (v.dtype, v.shape, v.flatten().tolist() if v.is_floating_point() else v.tolist())
        return v
    return [bits(dataclasses.asdict(r)) for r in layers]


class Busy(nn.Module):
    """Computes beside its children, and exercises what must not be reused: a child called again on a computed
    tensor, an input transformed before a child, a child that draws random numbers (dropout inside it, train
    mode), a child output changed in place by the parent."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = linear("a"), linear("b"), linear("c")
        self.noisy = Noisy()

    def forward(self, x):
        h = self.a(x)  # reusable
        h.mul_(0.5)  # the parent changes the child's output in place (in its re-run: the kept output)
        g = self.a(torch.relu(h))  # the same child on a computed tensor: computed again
        t = self.b(x * 2)  # the input transformed first: computed again (at b-on-x's random state, before it)
        u = self.b(x)  # reusable
        n = self.noisy(x)  # draws random numbers: computed again
        # the dropout after noisy's call draws what follows noisy's draws
        return torch.nn.functional.dropout(self.c(g + t + n), 0.2, self.training) + u


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = linear("noisy")

    def forward(self, x):
        return torch.nn.functional.dropout(self.fc(x), 0.3, self.training)


class BusyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.busy, self.head = linear("inp"), Busy(), linear("head", 16, 4)

    def forward(self, x):
        return self.head(self.busy(self.inp(x)))


class Counter(nn.Module):
    """Counts its calls in a plain attribute its output depends on: a call that rebinds it cannot be replaced by
    its outputs (the count would stay behind for the next call)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.calls = linear("counter"), 0

    def forward(self, x):
        self.calls = self.calls + 1
        return self.fc(x) * self.calls


class Twice(nn.Module):  # calls a stateful child twice on its own input
    def __init__(self) -> None:
        super().__init__()
        self.counter = Counter()

    def forward(self, x):
        return torch.tanh(self.counter(x) - self.counter(x))


class TwiceNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Twice()


class CheckpointedAttention(Attention):  # as Hugging Face's gradient checkpointing asks (reentrant; the audit's is not)
    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=True)


class CheckpointedNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.attn = CheckpointedAttention()


@pytest.mark.parametrize(("model_cls", "cuda"), [(Net, False), (BusyNet, False), (CheckpointedNet, False),
                                                 (TwiceNet, False), (BusyNet, True)],
                         ids=["attention", "busy", "checkpointed", "stateful-child", "busy-cuda-mode"])
def test_the_figures_are_the_same_bits_with_and_without_reuse(model_cls, cuda, monkeypatch):
    torch.manual_seed(0)
    model, x = model_cls().train(), torch.randn(2, 8, 16)
    with FakeCuda(cuda_dropout=True) if cuda else contextlib.nullcontext():
        if cuda:  # the model's dropout draws replayed from the FP32 pass's (capture/rng_replay.py)
            model, x = model.to("cuda"), x.to("cuda")
        off, runs_off = run(model, x, False, monkeypatch, cuda)
        on, runs_on = run(model, x, True, monkeypatch, cuda)
    assert _figures(on) == _figures(off)
    if model_cls is CheckpointedNet:  # inside the checkpointed segment of the attention's re-run, as without it
        assert sorted(runs_off) == sorted(runs_on + ["q", "k", "v"] * 2), (runs_off, runs_on)
    if model_cls is BusyNet:
        # per format: inside busy's re-run a on x and b on x are taken, a on relu(h), b on 2x, noisy (it draws) and
        # c computed; inside noisy's own re-run, fc (on noisy's input, drawing nothing itself) is taken
        assert sorted(runs_off) == sorted(runs_on + ["a", "b", "noisy"] * 2), (runs_off, runs_on)


class Raises(nn.Module):
    """Raises under autocast after calling its child: its re-run fails in every format."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = linear("fc")

    def forward(self, x):
        y = self.fc(x)
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError("no low precision here")
        return torch.tanh(y)


def test_nothing_stays_patched_after_a_raising_rerun(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(linear("inp"), Raises(), linear("head", 16, 4))
    before = {name: dict(m.__dict__) for name, m in model.named_modules()}
    layers, runs = run(model, torch.randn(4, 16), True, monkeypatch)
    note = {r.name: r for r in layers}["1"].formats[Format.BF16].local_note
    assert note is not None and "raised" in note, note
    # FP32 pass, fc's re-runs, the format passes: the failing re-runs took fc's kept outputs, then raised
    assert runs.count("fc") == 1 + 2 + 2, runs
    for name, m in model.named_modules():
        assert "forward" not in m.__dict__, f"{name or 'the model'} keeps a patched forward"
        assert m.__dict__.keys() == before[name].keys()
        assert not m._forward_hooks and not m._forward_pre_hooks, f"{name} keeps a hook"


def test_substituting_puts_each_forward_back_when_the_rerun_raises():
    from precision_audit.capture.rerun_reuse import ChildCall, call_key, child_call, substituting

    plain, wrapped, x = linear("plain"), linear("wrapped"), torch.randn(3, 16)
    own = wrapped.forward  # a forward of the instance's own (as accelerate's hooks set), put back as it was
    wrapped.forward = own
    assert child_call(plain, (x,), {}, None, [], [], (x,), True, lambda h: False) is not None
    assert child_call(wrapped, (x,), {}, None, [], [], (x,), True, lambda h: False) is None, \
        "an instance's own forward may hold state: not replayable"
    assert child_call(plain, (x,), {}, None, [], [], (), True, lambda h: False) is None, "not the parent's tensor"
    calls = []
    for m in (plain, wrapped):  # kept by hand for both
        ts: list[torch.Tensor] = []
        c = ChildCall(m, call_key((x,), {}, ts), ts, [x._version], None, [(m, dict(m.__dict__))])
        c.keep(Format.BF16, torch.zeros(3, 16), False)
        calls.append(c)
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
        with substituting(calls, Format.BF16, lambda c, gemm: True):
            assert plain.__dict__["forward"] is not None and wrapped.__dict__["forward"] is not own
            assert torch.equal(plain(x), torch.zeros(3, 16)), "a matching call takes the kept output"
            assert not torch.equal(plain(x), torch.zeros(3, 16)), "once"
            raise RuntimeError("boom")
    assert "forward" not in plain.__dict__
    assert wrapped.__dict__["forward"] is own
    assert all(not c.outputs for c in calls), "the outputs not taken are freed"
