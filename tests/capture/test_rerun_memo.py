"""A module's local re-run takes its children's outputs from their own re-runs where they are certain to be the
same bits (capture/rerun_memo.py; docs/performance.md, "Re-runs that reuse their children's").

The reference is the same capture with the reuse switched off: every local error sum and every loss impact must
be identical, bit for bit, and the reuse must actually happen where it may (and not where it may not)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from precision_audit.capture.runner import CaptureConfig, CaptureSession
from precision_audit.formats import Format


class Attention(nn.Module):
    """q, k and v of the block's own input (reusable), then own work and an output projection (not: its input
    is computed inside the block)."""

    def __init__(self, d=32):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, scale):
        a = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) * scale, dim=-1)
        return self.o(a @ self.v(x))


class Mlp(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.up, self.gate, self.down = nn.Linear(d, 64), nn.Linear(d, 64), nn.Linear(64, d)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp, self.norm = Attention(), Mlp(), nn.LayerNorm(32)

    def forward(self, x, scale):
        x = x + self.attn(self.norm(x), scale)
        return x + self.mlp(x) * 0.5


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x, 32 ** -0.5)
        return self.head(x)


class Dropping(nn.Module):
    """A child that draws random numbers: its output must never be reused (the re-run's draws would differ)."""

    def __init__(self):
        super().__init__()
        self.drop, self.lin = nn.Dropout(0.5), nn.Linear(32, 32)

    def forward(self, x):
        return self.lin(self.drop(x)) * 2


class OutsideAutocast(nn.Module):
    """Calls its child on its own input with autocast off: same tensor, other numerics, so no reuse."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            y = self.lin(x.float())
        return torch.tanh(y) + self.lin(x) * 0.25


class InPlace(nn.Module):
    """The parent changes its input in place before calling its child: the child sees other values then."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        a = self.lin(x)
        x.mul_(2)
        return a * self.lin(x)


class Edge(nn.Module):
    def __init__(self):
        super().__init__()
        self.dropping, self.outside, self.inplace, self.head = Dropping(), OutsideAutocast(), InPlace(), \
            nn.Linear(32, 4)

    def forward(self, x):
        y = self.outside(self.dropping(x))
        return self.head(self.inplace(y * 1.0))


class Aliasing(nn.Module):
    """A computing child that also hands back its input, which the parent then changes in place: a copy in its
    place would change what the parent's re-run computes (kept from that twice: the input's version moves, and
    an output sharing an input's memory is never kept)."""

    def forward(self, x):
        return x, torch.tanh(x)


class UsesAlias(nn.Module):
    def __init__(self):
        super().__init__()
        self.alias, self.lin = Aliasing(), nn.Linear(32, 32)

    def forward(self, x):
        same, t = self.alias(x)
        same.mul_(3)  # changes x itself
        return self.lin(x) * t


class Hooked(nn.Module):
    """A child with the user's own forward hook (doubling its output): handing over the hooked output of the
    child's re-run would apply the hook twice."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(32, 32), nn.Linear(32, 4)
        self.lin.register_forward_hook(lambda m, a, out: out * 2)

    def forward(self, x):
        return self.head(torch.relu(self.lin(x)) * 0.5)


def _capture(model: nn.Module, x: torch.Tensor, reuse: bool):
    config = CaptureConfig((Format.FP16, Format.BF16))
    with CaptureSession(model, lambda m: m(x), lambda y: y.pow(2).mean(), config) as s:
        s._memo.enabled = reuse
        s.reference_run()
        layers = {r.name: r for r in s.result().layers}
        reused = s._memo.reused
    figures = {name: {f.value: (dataclasses.asdict(fs.local) if fs.local else fs.local_note,
                                fs.loss_impact, fs.loss_impact_abs)
                      for f, fs in rec.formats.items()}
               for name, rec in layers.items()}
    return figures, reused


def test_reuse_changes_no_figure_and_happens():
    torch.manual_seed(0)
    model, x = Net().train(), torch.randn(4, 8, 32)
    with_reuse, reused = _capture(model, x, True)
    without, none = _capture(model, x, False)
    assert none == 0
    # per block and format: in the attention's re-run q, k and v of its input; in the MLP's, up and gate; in the
    # block's (its own work: the * 0.5), the norm of the block's input. The attention's input (the norm's
    # output) and the MLP's (a sum) are computed inside the block: the block's re-run runs them anew.
    assert reused == 2 * 2 * 6
    assert with_reuse == without  # every local error sum and loss impact, exactly


def test_no_reuse_where_the_result_could_differ():
    torch.manual_seed(0)
    model, x = Edge().train(), torch.randn(4, 32)
    with_reuse, reused = _capture(model, x, True)
    without, _ = _capture(model, x, False)
    assert with_reuse == without
    # dropping.lin takes dropping's dropout output (computed inside): not reusable anyway; dropping.drop draws
    # random numbers: not kept. outside.lin's first call runs under autocast off: the kept output of its re-run
    # (under autocast) must not answer it; its second call (under autocast, the same tensor) is answered, in
    # each format (2). inplace: the parent changes its input in place, so what answers is decided by the
    # input's version: in the first format's re-run of the parent, its first call sees the version of the
    # reference's second call and is answered from that call's re-run (same values); the re-run changes the
    # input once more, so in the second format nothing matches any kept version (1).
    assert reused == 2 + 1


def test_no_reuse_of_an_output_sharing_its_input_or_of_a_hooked_module():
    for inner in (UsesAlias(), Hooked()):
        torch.manual_seed(0)
        model, x = nn.Sequential(inner, nn.Linear(inner(torch.zeros(1, 32)).shape[-1], 4)), torch.randn(4, 32)
        with_reuse, reused = _capture(model, x.clone(), True)
        without, _ = _capture(model, x.clone(), False)
        assert reused == 0, type(inner).__name__
        assert with_reuse == without


def test_the_model_is_left_as_it_was():
    torch.manual_seed(0)
    model, x = Net().train(), torch.randn(4, 8, 32)
    before = {id(m): dict(m.__dict__) for m in model.modules()}
    _capture(model, x, True)
    for m in model.modules():
        assert "forward" not in m.__dict__
        assert set(m.__dict__) == set(before[id(m)])
