"""The controller's source attribution by replay (runtime/controller.py, "Source attribution"; issue 14 item 6).

A clean step installs nothing per module (two hooks on the root); a bad step replays its forward from the state
it started in, names the same source the per-call hooks would, and leaves the model exactly as the first run
left it (attributes, buffers, RNG). A replay that cannot reproduce the step names no source and says why.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

import precision_audit as pa
from precision_audit.runtime.controller import _ReplayProbe, _SourceProbe
from test_runtime_nonfinite import Chain, _chain_policy


class Noisy(nn.Module):
    """Dropout, BatchNorm running statistics and a call counter: all state a replay must put back; the
    overflow depends on the dropout mask and the counter."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.drop(self.bn(self.a(x)))
        if self.calls == 3:
            h = h * 1e39
        return self.b(h)


def _state(model: nn.Module) -> dict:
    return {"buffers": {k: v.clone() for k, v in model.named_buffers()}, "calls": model.calls,
            "rng": torch.get_rng_state().clone(), "keys": {n: sorted(m.__dict__) for n, m in model.named_modules()}}


def test_clean_steps_install_no_per_module_hooks_and_a_bad_step_is_replayed():
    torch.manual_seed(0)
    model = Noisy()
    policy = _chain_policy(model, "fp32")
    ctl = pa.controller(model, torch.optim.SGD(model.parameters(), lr=0.01), policy, device="cpu")
    assert isinstance(ctl._probe, _ReplayProbe)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules() if m is not model)
    x = torch.randn(16, 8)
    records, after = [], []
    for _ in range(4):
        loss = model(x).pow(2).mean()
        before_step = _state(model)
        records.append(ctl.step(loss))
        after.append((before_step, _state(model)))
    assert [r.skipped for r in records] == [False, False, True, False]
    assert records[2].sources == ("",), records[2].sources  # Noisy's own forward (the root) made them
    assert "from finite inputs" in records[2].source_detail
    # the replay left the model as the first run had: the counter, every buffer, the RNG, no new attributes
    before, now = after[2]
    assert now["calls"] == before["calls"] == 3
    assert all(torch.equal(before["buffers"][k], now["buffers"][k]) for k in before["buffers"])
    assert torch.equal(before["rng"], now["rng"]) and before["keys"] == now["keys"]
    assert all(not m._forward_hooks for m in model.modules() if m is not model), "the replay's hooks are gone"
    ctl.close()
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_a_source_inside_a_dropout_block_is_found_with_the_same_mask():
    """A dropout mask in the step: the replay reproduces the step's outputs exactly (else it names no source), so it
    must draw the same mask."""
    torch.manual_seed(0)

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.5)
            self.head = nn.Linear(64, 1)

        def forward(self, x):
            return self.head(self.drop(x))

    model = Masked()
    spike = {"on": False}
    model.drop.register_forward_hook(lambda m, i, o: o * 1e39 if spike["on"] else o)
    policy = _chain_policy(model, "fp32")
    ctl = pa.controller(model, torch.optim.SGD(model.parameters(), lr=0.01), policy, device="cpu")
    spike["on"] = True
    rec = ctl.step(model(torch.randn(4, 64)).sum())
    assert rec.skipped and rec.sources == ("drop",), rec.sources
    ctl.close()


def test_a_step_the_replay_cannot_reproduce_names_no_source_and_says_why(caplog):
    torch.manual_seed(0)
    model = Chain()
    fault = {"on": True}
    model.b.register_forward_hook(lambda m, i, o: o * 1e39 if fault["on"] else o)
    policy = _chain_policy(model)
    ctl = pa.controller(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, device="cpu")
    caplog.set_level(logging.WARNING, logger="precision_audit")
    with pa.autocast(policy, "cpu"):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    fault["on"] = False  # state outside the model changed between the forward and the step
    rec = ctl.step(loss)
    assert rec.skipped and rec.sources == ()
    assert any("could not be replayed exactly" in m.getMessage() and "other outputs" in m.getMessage()
               for m in caplog.records)
    ctl.close()

    class Scaled(nn.Module):  # its input is not saved for backward, so the caller may modify it after the forward
        def __init__(self) -> None:
            super().__init__()
            self.chain = Chain()

        def forward(self, x):
            return self.chain(x * 1.0)

    model = Scaled()
    model.chain.b.register_forward_hook(lambda m, i, o: o * 1e39)
    ctl = pa.controller(model, torch.optim.SGD(model.parameters(), lr=0.1), _chain_policy(model), device="cpu")
    x = torch.randn(4, 8)
    loss = model(x).float().pow(2).mean()
    x.mul_(2)  # an input modified in place after the forward
    rec = ctl.step(loss)
    assert rec.skipped and rec.sources == ()
    assert any("modified in place" in m.getMessage() for m in caplog.records)
    ctl.close()


def test_adaptive_mode_keeps_the_per_call_hooks():
    torch.manual_seed(0)
    model = Chain()
    ctl = pa.controller(model, torch.optim.SGD(model.parameters(), lr=0.1), _chain_policy(model), device="cpu",
                                           adaptive=True)
    assert isinstance(ctl._probe, _SourceProbe) and model.a._forward_hooks
    ctl.close()
