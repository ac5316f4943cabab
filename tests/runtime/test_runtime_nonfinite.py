"""Issue 11, class 2: a non-finite gradient never reaches the optimizer, in any format, and the step's source is
named before any update (docs/policy.md, "The runtime").

The acceptance case: a model with one module ("mid") whose output is multiplied past the float range every 5th
step, 30 steps, under FP32, BF16 (no loss scaling), FP16 without and with a GradScaler. Parameters stay finite,
exactly the injected steps are skipped (and skipped steps leave the parameters bit-identical), each is logged at
WARNING naming "mid", and the adaptive fallback promotes "mid" and nothing else.
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import precision_audit as pa
from precision_audit.policy import LossScaling, Policy, fingerprint, model_layout
from precision_audit.runtime.controller import OUTSIDE_THE_MODEL

EVERY = 5
STEPS = 30
INJECTED = [s for s in range(1, STEPS + 1) if s % EVERY == 0]  # 1-based step numbers


class Spiky(nn.Module):
    """A linear layer whose output overflows (x 1e39, past every float format's range) on every 5th call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = self.lin(x)
        return y * 1e39 if self.calls % EVERY == 0 else y


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.mid = Spiky()
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x)))))


def make_policy(model: nn.Module, default: str, scaling: bool) -> Policy:
    fp, n = fingerprint(model)
    return Policy(model_class=type(model).__name__, model_fingerprint=fp, model_modules=n, target_name="H100 SXM",
                  target_compute_capability=(9, 0), default_format=default, modules={},
                  loss_scaling=LossScaling(enabled=scaling, init_scale=1024.0, growth_interval=10_000),
                  model_layout=model_layout(model))


CASES = [("fp32", False), ("bf16", False), ("fp16", False), ("fp16", True)]


def train(default: str, scaling: bool, adaptive: bool = False, promote_after: int = 3, device: str = "cpu"):
    """STEPS steps of Net under ``default`` (tests/gpu/test_runtime_gpu.py runs it with ``device="cuda"``)."""
    torch.manual_seed(0)
    model = Net().to(device)
    policy = make_policy(model, default, scaling)
    handle = pa.apply_policy(model, policy, device_type=device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctl = pa.controller(model, opt, policy, device=device, adaptive=adaptive, promote_after=promote_after)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 16, generator=g).to(device), torch.randn(16, 4, generator=g).to(device)
    records, unchanged = [], []
    for _ in range(STEPS):
        before = copy.deepcopy(model.state_dict())
        with pa.autocast(policy, device):
            loss = F.mse_loss(model(x).float(), y)
        rec = ctl.step(loss)
        records.append(rec)
        unchanged.append(all(torch.equal(before[k], v) for k, v in model.state_dict().items()))
    return model, ctl, records, unchanged, handle


@pytest.mark.parametrize("default,scaling", CASES, ids=[f"{d}{'-scaler' if s else ''}" for d, s in CASES])
def test_inf_every_fifth_step_is_skipped_counted_and_blamed_on_its_module(default, scaling, caplog):
    caplog.set_level(logging.WARNING, logger="precision_audit")
    model, ctl, records, unchanged, handle = train(default, scaling)
    handle.remove()
    ctl.close()
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), f"{name} was poisoned"
    skipped = [r.step for r in records if r.skipped]
    assert skipped == INJECTED, skipped
    assert ctl.skipped_steps == len(INJECTED) == ctl.monitor.summary()["skipped_steps"]
    for r, same in zip(records, unchanged):
        assert same == r.skipped, f"step {r.step}: a skipped step must leave the parameters as they were, " \
                                  "a clean one must update them"
        if r.skipped:
            assert r.sources == ("mid",), (r.step, r.sources)
            assert "+inf" in r.source_detail and "finite inputs" in r.source_detail
            assert not math.isfinite(r.loss)
        else:
            assert r.sources == () and math.isfinite(r.loss) and math.isfinite(r.grad_norm)
    warnings = [m.getMessage() for m in caplog.records if m.levelno == logging.WARNING and "skipped" in m.getMessage()]
    assert len(warnings) == len(INJECTED), warnings
    assert all("they start in 'mid'" in w for w in warnings), warnings
    assert warnings[-1].endswith(f"({len(INJECTED)} step(s) skipped so far)")
    clean = [r.loss for r in records if not r.skipped]
    assert clean[-1] < clean[0], "the clean steps should train"


@pytest.mark.parametrize("default,scaling", [("bf16", False), ("fp16", True)], ids=["bf16", "fp16-scaler"])
def test_adaptive_names_and_promotes_only_the_guilty_module(default, scaling, caplog):
    caplog.set_level(logging.WARNING, logger="precision_audit")
    model, ctl, records, _, handle = train(default, scaling, adaptive=True, promote_after=1)
    promotions = ctl.monitor.summary()["promotions"]
    assert promotions == [{"step": INJECTED[0], "module": "mid"}], promotions
    assert set(ctl.policy.modules) == {"mid"}
    reason = ctl.policy.modules["mid"].reason
    assert f"from {default} to fp32" in reason and "+inf" in reason and "finite inputs" in reason, reason
    assert f"step {INJECTED[0]}" in reason
    # the fault is not a precision one: after the promotion it goes on, is skipped, and is reported once
    assert [r.step for r in records if r.skipped] == INJECTED
    assert sum("already runs in fp32" in m.getMessage() for m in caplog.records) == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    handle.remove()
    ctl.close()


def test_default_promote_after_needs_consecutive_steps():
    """Every 5th step is not 3 steps in a row: no promotion at all, the skips still happen."""
    _, ctl, records, _, handle = train("bf16", False, adaptive=True)
    assert ctl.policy.modules == {} and ctl.monitor.summary()["promotions"] == []
    assert ctl.skipped_steps == len(INJECTED)
    handle.remove()
    ctl.close()


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def _chain_policy(model, default="bf16"):
    return make_policy(model, default, False)


def test_the_first_source_in_forward_order_is_named_not_a_later_one():
    """b overflows; c's output is non-finite too but from non-finite inputs; a later module that makes its own
    inf from a side input (not b's output) is second in forward order: b is named."""
    torch.manual_seed(0)
    model = Chain()
    model.b.register_forward_hook(lambda m, i, o: o * 1e39)
    model.c.register_forward_hook(lambda m, i, o: o + torch.full_like(o, float("nan")))
    policy = _chain_policy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = pa.controller(model, opt, policy, device="cpu")
    before = copy.deepcopy(model.state_dict())
    with pa.autocast(policy, "cpu"):
        rec = ctl.step(model(torch.randn(4, 8)).float().pow(2).mean())
    assert rec.skipped and rec.sources == ("b",), rec.sources
    assert set(rec.nonfinite_modules) >= {"a", "b"}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    ctl.close()


def test_non_finite_model_inputs_blame_no_module(caplog):
    torch.manual_seed(0)
    model = Chain()
    policy = _chain_policy(model)
    ctl = pa.controller(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, device="cpu", adaptive=True,
                            promote_after=1)
    caplog.set_level(logging.WARNING, logger="precision_audit")
    x = torch.randn(4, 8)
    x[0, 0] = float("nan")
    with pa.autocast(policy, "cpu"):
        rec = ctl.step(model(x).float().pow(2).mean())
    assert rec.skipped and rec.sources == () and rec.promoted == ()
    assert any("inputs were not finite" in m.getMessage() for m in caplog.records)
    ctl.close()


def test_a_loss_that_overflows_blames_no_module(caplog):
    torch.manual_seed(0)
    model = Chain()
    policy = _chain_policy(model, "fp32")
    ctl = pa.controller(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, device="cpu", adaptive=True,
                            promote_after=1)
    caplog.set_level(logging.WARNING, logger="precision_audit")
    with pa.autocast(policy, "cpu"):
        rec = ctl.step((model(torch.randn(4, 8)).float() * 1e30).pow(2).sum())
    assert rec.skipped and rec.sources == () and rec.promoted == ()
    assert any("they start in the loss" in m.getMessage() for m in caplog.records)
    ctl.close()


def test_an_optimizer_parameter_outside_the_model_is_checked_too():
    torch.manual_seed(0)
    model = Chain()
    temperature = nn.Parameter(torch.ones(()))
    policy = _chain_policy(model)
    opt = torch.optim.SGD([*model.parameters(), temperature], lr=0.1)
    ctl = pa.controller(model, opt, policy, device="cpu")
    with pa.autocast(policy, "cpu"):
        out = model(torch.randn(4, 8)).float()
    loss = out.pow(2).mean() + torch.sqrt(temperature - 1.0)  # d sqrt(t - 1)/dt at t = 1 is inf; the loss is finite
    rec = ctl.step(loss)
    assert rec.skipped and rec.nonfinite_modules == (OUTSIDE_THE_MODEL,) and math.isfinite(rec.loss)
    assert temperature.item() == 1.0
    ctl.close()


def test_a_norm_that_overflows_from_finite_gradients_is_not_skipped():
    """The total norm is only the gate: huge but finite gradients (norm > fp32 max) still update."""
    torch.manual_seed(0)
    model = Chain()
    policy = _chain_policy(model, "fp32")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = pa.controller(model, opt, policy, device="cpu")
    rec = ctl.step(model(torch.randn(4, 8)).sum() * 1e37)
    assert not math.isfinite(rec.grad_norm), "the case must overflow the norm"
    assert not rec.skipped and rec.nonfinite_modules == () and ctl.skipped_steps == 0
    ctl.close()


@pytest.mark.parametrize("max_grad_norm", [None, 1.0], ids=["unclipped", "clipped"])
def test_clipping_blames_and_promotes_only_the_module_whose_gradient_is_non_finite(max_grad_norm):
    """Issue 31 defect 4: a NaN only in c.weight's gradient gives a NaN total norm; clipping with it before the scan
    multiplied every gradient by NaN, so a, b and c were reported and, in adaptive mode, all three promoted."""
    torch.manual_seed(0)
    model = Chain()
    model.c.weight.register_hook(lambda g: g * float("nan"))  # c's output gradient stays finite
    policy = _chain_policy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = pa.controller(model, opt, policy, device="cpu", max_grad_norm=max_grad_norm, adaptive=True)
    before = copy.deepcopy(model.state_dict())
    for _ in range(3):  # promote_after=3
        with pa.autocast(policy, "cpu"):
            rec = ctl.step(model(torch.randn(4, 8)).float().pow(2).mean())
        assert rec.skipped and rec.nonfinite_modules == ("c",), rec.nonfinite_modules
        assert rec.sources == ("c",), rec.sources
    assert rec.promoted == ("c",) and set(ctl.policy.modules) == {"c"}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    ctl.close()


def test_clipping_applies_to_the_steps_that_update():
    """The clip (after the check now) still scales a clean step's gradients as clip_grad_norm_ does."""
    torch.manual_seed(0)
    a, b = Chain(), Chain()
    b.load_state_dict(a.state_dict())
    policy = _chain_policy(a, "fp32")
    ctl = pa.controller(a, torch.optim.SGD(a.parameters(), lr=0.1), policy, device="cpu", max_grad_norm=0.05)
    opt = torch.optim.SGD(b.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(4, 8)
        rec = ctl.step(a(x).pow(2).mean())
        b(x).pow(2).mean().backward()
        total = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        assert not rec.skipped and rec.grad_norm == pytest.approx(float(total), rel=1e-6)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
    ctl.close()


# --- two ranks (gloo): the skip and the source are agreed without a GradScaler ------------------------------

DDP_STEPS = 4
DDP_BAD_STEP = 2  # 1-based: the step at which rank 1 alone overflows in "mid"


def _ddp_worker(rank: int, port: int, out_dir: str) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = Chain()
        fault = {"on": False}
        model.b.register_forward_hook(lambda m, i, o: o * 1e39 if fault["on"] else o)
        policy = _chain_policy(model, "bf16")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        ctl = pa.controller(ddp, opt, policy, device="cpu")
        g = torch.Generator().manual_seed(10 + rank)
        rows = []
        for step in range(1, DDP_STEPS + 1):
            fault["on"] = step == DDP_BAD_STEP and rank == 1
            x = torch.randn(4, 8, generator=g)
            if step == DDP_BAD_STEP:
                with ddp.no_sync():  # DDP does not all-reduce this step's gradients: only rank 1's are non-finite
                    with pa.autocast(policy, "cpu"):
                        rec = ctl.step(ddp(x).float().pow(2).mean())
            else:
                with pa.autocast(policy, "cpu"):
                    rec = ctl.step(ddp(x).float().pow(2).mean())
            rows.append((rec.skipped, rec.sources, rec.nonfinite_modules))
        torch.save({"rows": rows, "skipped": ctl.skipped_steps,
                    "params": {k: v.detach().clone() for k, v in model.state_dict().items()}},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        ctl.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes: ~25 s on a loaded 2-core machine
def test_two_ranks_skip_together_and_name_the_same_source_without_a_scaler(tmp_path):
    import socket

    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    for r in (r0, r1):
        assert [row[0] for row in r["rows"]] == [s == DDP_BAD_STEP for s in range(1, DDP_STEPS + 1)]
        assert r["rows"][DDP_BAD_STEP - 1][1] == ("b",), r["rows"]
        assert r["skipped"] == 1
    # the non-finite modules are agreed across ranks (rank 0's own gradients were finite): both name the same
    assert r0["rows"][DDP_BAD_STEP - 1][2] == r1["rows"][DDP_BAD_STEP - 1][2] and "b" in r1["rows"][DDP_BAD_STEP - 1][2]
    for k in r0["params"]:
        assert torch.equal(r0["params"][k], r1["params"][k]), k
        assert torch.isfinite(r0["params"][k]).all()


def test_without_attribution_steps_are_still_skipped(caplog):
    torch.manual_seed(0)
    model = Net()
    policy = make_policy(model, "bf16", False)
    with pytest.raises(Exception, match="attribute=True"):
        pa.controller(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, device="cpu", adaptive=True,
                          attribute=False)
    ctl = pa.controller(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, device="cpu", attribute=False)
    assert all(not m._forward_hooks for m in model.modules()), "attribute=False installs no hooks"
    caplog.set_level(logging.WARNING, logger="precision_audit")
    x = torch.randn(4, 16)
    records = []
    for _ in range(EVERY):
        with pa.autocast(policy, "cpu"):
            records.append(ctl.step(model(x).float().pow(2).mean()))
    assert [r.skipped for r in records] == [False] * (EVERY - 1) + [True] and records[-1].sources == ()
    assert ctl.skipped_steps == 1 and all(torch.isfinite(p).all() for p in model.parameters())
    assert any("no source recorded" in m.getMessage() for m in caplog.records)


def test_a_gradscaler_backoff_from_a_too_high_scale_is_routine_info_not_a_warning(caplog):
    torch.manual_seed(0)
    model = Chain()
    fp, n = fingerprint(model)
    policy = Policy(model_class="Chain", model_fingerprint=fp, model_modules=n, target_name="H100 SXM",
                    target_compute_capability=(9, 0), default_format="fp16", modules={},
                    loss_scaling=LossScaling(enabled=True, init_scale=2.0 ** 60), model_layout=model_layout(model))
    ctl = pa.controller(model, torch.optim.SGD(model.parameters(), lr=0.01), policy, device="cpu")
    caplog.set_level(logging.INFO, logger="precision_audit")
    x = torch.randn(4, 8) * 100
    records = []
    for _ in range(3):
        with pa.autocast(policy, "cpu"):
            records.append(ctl.step(model(x).float().pow(2).mean()))
    assert records[0].skipped and math.isfinite(records[0].loss), "2^60 must overflow the fp16 backward"
    skips = [m for m in caplog.records if "skipped" in m.getMessage()]
    assert skips and all(m.levelno == logging.INFO for m in skips)
    assert all("every module output was finite: they start in the backward pass" in m.getMessage() for m in skips)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    ctl.close()


def test_the_hooks_compile_without_graph_breaks_and_still_name_the_source():
    """fullgraph=True refuses any graph break: the hooks' compiled path records without id()/weakrefs."""
    torch.manual_seed(0)
    model = Chain()
    fault = {"on": False}
    model.b.register_forward_hook(lambda m, i, o: o * 1e39 if fault["on"] else o)
    policy = _chain_policy(model, "fp32")
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    ctl = pa.controller(compiled, torch.optim.SGD(model.parameters(), lr=0.1), policy, device="cpu")
    records = []
    for step in range(3):
        fault["on"] = step == 2
        records.append(ctl.step(compiled(torch.randn(4, 8)).pow(2).mean()))
    assert [r.skipped for r in records] == [False, False, True]
    assert records[2].sources == ("b",) and "finite inputs" in records[2].source_detail
    assert all(torch.isfinite(p).all() for p in model.parameters())
    ctl.close()


def test_a_step_whose_forward_draws_from_numpy_is_replayed_with_the_same_draws():
    """The source is found by replaying the bad step's forward (docs/performance.md, "The runtime"). A forward
    that draws from NumPy's global generator (wav2vec2's SpecAugment masks) draws the same again in the replay:
    here the draw decides whether "coin" overflows, with a seed whose next draw would not."""
    import numpy as np

    class Coin(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            return y * 1e39 if np.random.rand() < 0.5 else y

    class Net2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.coin, self.out = nn.Linear(8, 8), Coin(), nn.Linear(8, 2)

        def forward(self, x):
            return self.out(self.coin(torch.relu(self.a(x))))

    seed = next(s for s in range(1000) if (np.random.seed(s) or True) and np.random.rand() < 0.5
                and np.random.rand() >= 0.5)
    torch.manual_seed(0)
    model = Net2()
    policy = make_policy(model, "bf16", False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = pa.controller(model, opt, policy, device="cpu")
    np.random.seed(seed)
    with pa.autocast(policy, "cpu"):
        rec = ctl.step(model(torch.randn(4, 8)).float().pow(2).mean())
    assert rec.skipped and rec.sources == ("coin",), (rec.sources, rec.source_detail)
    ctl.close()
