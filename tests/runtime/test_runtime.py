"""The runtime on CPU autocast: per-module formats (every module's output dtype is the policy's), exact removal,
pa.autocast(policy) and its TF32 switches, the GradScaler, and the controller (a 20-step FP16 loop on the FP16-trouble
sample, adaptive promotion of a planted overflowing module, and step-for-step equality with a hand-written
torch.amp loop)."""

from __future__ import annotations

import copy
import logging
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import precision_audit as pa
from precision_audit import load_policy
from precision_audit.errors import OptionError, PolicyError
from precision_audit.policy import LossScaling, ModuleOverride, Policy, fingerprint, model_layout
from precision_audit.runtime import PolicyHandle, StabilityMonitor, active_handle

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())  # the repository
sys.path.insert(0, str(ROOT / "sample_models" / "fp16_trouble"))
import model as fp16_trouble  # noqa: E402

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.block(self.a(x)))


def make_policy(model: nn.Module, default: str, overrides: dict[str, str] | None = None,
                loss_scaling: LossScaling | None = None, **kw) -> Policy:
    fp, n = fingerprint(model)
    return Policy(model_class=type(model).__name__, model_fingerprint=fp, model_modules=n, target_name="test",
                  target_compute_capability=None, default_format=default,
                  modules={k: ModuleOverride(v, "test") for k, v in (overrides or {}).items()},
                  loss_scaling=loss_scaling or LossScaling(), model_layout=model_layout(model), **kw)


def record_dtypes(model: nn.Module) -> tuple[dict[str, torch.dtype], dict[str, torch.dtype], list]:
    """Forward hooks recording each module's output dtype and first input dtype."""
    out, inp, handles = {}, {}, []
    for name, m in model.named_modules():
        handles.append(m.register_forward_hook(lambda mod, i, o, name=name: out.__setitem__(name, o.dtype)))
        handles.append(m.register_forward_pre_hook(lambda mod, i, name=name: inp.__setitem__(name, i[0].dtype)))
    return out, inp, handles


def module_state(model: nn.Module) -> dict:
    return {name: ("forward" in m.__dict__, m.__dict__.get("forward"), list(m._forward_hooks.items()),
                   list(m._forward_pre_hooks.items())) for name, m in model.named_modules()}


CASES = [
    ("bf16", {"block": "fp32", "block.2": "fp16", "head": "fp16"}),
    ("fp16", {"a": "fp32", "block": "bf16", "block.1": "fp32"}),
    ("fp32", {"block": "bf16", "head": "fp16"}),
    ("bf16", {"": "fp32", "head": "bf16"}),
]


@pytest.mark.parametrize("default,overrides", CASES, ids=["bf16+fp32+fp16", "fp16+bf16", "fp32+low", "root-fp32"])
def test_every_linear_outputs_the_policys_dtype(default, overrides):
    model = Net()
    policy = make_policy(model, default, overrides)
    out, inp, _ = record_dtypes(model)
    handle = pa.apply_policy(model, policy)
    x = torch.randn(8, 16)
    with pa.autocast(policy, "cpu"):
        model(x)
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            want = DTYPES[policy.effective_format(name)]
            assert out[name] == want, f"{name}: output {out[name]}, policy says {policy.effective_format(name)}"
    for name, fmt in overrides.items():
        if fmt == "fp32":  # inputs of an fp32 module are cast up: its first child sees fp32
            inner = [n for n, m in model.named_modules() if n.startswith(name + ".") or (not name and n)]
            for child in inner[:1]:
                assert inp[child] == torch.float32, (name, child, inp[child])
    handle.remove()


def test_remove_restores_forwards_and_hooks_exactly_and_bit_identically():
    model = Net()
    user_forward = model.block.forward  # a user-installed instance forward must come back as the same object
    model.block.forward = user_forward
    model.a.register_forward_hook(lambda m, i, o: None)
    policy = make_policy(model, "bf16", {"block": "fp32", "block.2": "fp16", "head": "fp32", "a": "fp16"})
    x = torch.randn(8, 16)
    with pa.autocast(policy, "cpu"):
        before = model(x)
    state = module_state(model)
    handle = pa.apply_policy(model, policy)
    assert isinstance(handle, PolicyHandle) and active_handle(model) is handle
    assert handle.modules == {"a": "fp16", "block": "fp32", "block.2": "fp16", "head": "fp32"}
    with pa.autocast(policy, "cpu"):
        during = model(x)
    assert not torch.equal(before.float(), during.float())
    handle.remove()
    assert module_state(model) == state
    assert model.block.__dict__["forward"] is user_forward
    assert active_handle(model) is None
    with pa.autocast(policy, "cpu"):
        after = model(x)
    assert after.dtype == before.dtype and torch.equal(after, before)
    handle.remove()  # twice is fine


def test_apply_as_context_manager_and_twice_refused():
    model = Net()
    policy = make_policy(model, "bf16", {"head": "fp32"})
    with pa.apply_policy(model, policy) as h:
        with pytest.raises(PolicyError, match="already applied"):
            pa.apply_policy(model, policy)
        assert h.active
    assert not h.active and "forward" not in model.head.__dict__
    pa.apply_policy(model, policy).remove()


def test_a_raising_module_leaves_autocast_state_intact():
    model = Net()

    def boom(x):
        raise RuntimeError("user error")

    model.block[2].forward = boom
    policy = make_policy(model, "bf16", {"block": "fp32", "block.2": "fp16"})
    with pa.apply_policy(model, policy), pa.autocast(policy, "cpu"):
        with pytest.raises(RuntimeError, match="user error"):
            model(torch.randn(2, 16))
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


def test_deepcopy_of_an_applied_model_runs_the_copy():
    model = Net()
    policy = make_policy(model, "bf16", {"head": "fp32"})
    handle = pa.apply_policy(model, policy)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.head.weight.zero_()
        clone.head.bias.zero_()
    x = torch.randn(4, 16)
    with pa.autocast(policy, "cpu"):
        y_clone, y = clone(x), model(x)
    assert y_clone.dtype == torch.float32 and torch.count_nonzero(y_clone) == 0
    assert torch.count_nonzero(y) > 0
    handle.remove()


def test_apply_refuses_another_model_with_the_names():
    policy = make_policy(Net(), "bf16", {"head": "fp32"})
    other = Net()
    other.head = nn.Linear(16, 5)
    with pytest.raises(PolicyError) as e:
        pa.apply_policy(other, policy)
    assert "head: Linear[weight:4x16,bias:4] -> Linear[weight:5x16,bias:5]" in e.value.message
    assert "forward" not in other.head.__dict__
    pa.apply_policy(other, policy, strict=False).remove()  # strict=False: a logged warning, the names still exist


def test_fp8_override_is_refused_by_the_runtime():
    model = Net()
    policy = make_policy(model, "bf16", {"head": "fp8_e4m3"})
    with pytest.raises(PolicyError, match="autocast has no fp8"):
        pa.apply_policy(model, policy)
    assert active_handle(model) is None and "forward" not in model.head.__dict__


@pytest.mark.parametrize("default,matmul,enabled,dtype", [
    ("bf16", True, True, torch.bfloat16), ("fp16", False, True, torch.float16), ("fp32", True, False, None),
    ("tf32", True, False, None)], ids=["bf16", "fp16", "fp32", "tf32"])
def test_autocast_context_and_tf32_switches(default, matmul, enabled, dtype):
    policy = make_policy(Net(), default, tf32_matmul=matmul, tf32_cudnn=False)
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    with pa.autocast(policy, "cpu"):
        assert torch.is_autocast_enabled("cpu") is enabled
        if dtype is not None:
            assert torch.get_autocast_dtype("cpu") == dtype
        want = (True, True) if default == "tf32" else (matmul, False)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == want
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == saved
    with pytest.raises(ZeroDivisionError), pa.autocast(policy, "cpu"):
        raise ZeroDivisionError
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == saved
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("fmt,inner", [("tf32", True), ("fp32", False)])
@pytest.mark.parametrize("outer", [True, False], ids=["tf32-on-outside", "tf32-off-outside"])
def test_tf32_and_fp32_modules_set_tf32_inside_on_cuda(fmt, inner, outer):
    """With device_type="cuda" the wrappers switch TF32 inside the module (checked on CPU tensors: only flags;
    the module's own pre-hooks run outside its forward, so a child's pre-hook looks)."""
    model = Net()
    policy = make_policy(model, "bf16", {"block": fmt})
    seen = []
    model.block[0].register_forward_pre_hook(lambda m, i: seen.append(
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)))
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = outer
        with pa.apply_policy(model, policy, device_type="cuda"):
            model(torch.randn(2, 16))
        assert seen == [(inner, inner)]
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (outer, outer)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_grad_scaler_from_the_policy():
    ls = LossScaling(enabled=True, init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7)
    s = pa.grad_scaler(make_policy(Net(), "fp16", loss_scaling=ls), "cpu")
    assert s.is_enabled() and s.get_scale() == 1024.0
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (4.0, 0.25, 7)
    assert not pa.grad_scaler(make_policy(Net(), "bf16"), "cpu").is_enabled()


def test_apply_on_a_compiled_model():
    model = Net()
    compiled = torch.compile(model, backend="eager")
    policy = make_policy(model, "bf16", {"head": "fp32"})
    x = torch.randn(4, 16)
    with pa.autocast(policy, "cpu"):
        assert compiled(x).dtype == torch.bfloat16  # compiled before the policy is applied
    handle = pa.apply_policy(compiled, policy)
    assert handle.modules == {"head": "fp32"}  # the original names, not _orig_mod.head
    with pa.autocast(policy, "cpu"):
        assert compiled(x).dtype == torch.float32
    handle.remove()
    with pa.autocast(policy, "cpu"):
        assert compiled(x).dtype == torch.bfloat16


# -- the controller ----------------------------------------------------------------------------------------

def audit_policy(**loss_scaling) -> Policy:
    """What the audit writes for fp16_trouble on V100 (tests/policy/test_policy.py V1_POLICY), with the layout."""
    m = fp16_trouble.build_model()
    ls = LossScaling(**{"enabled": True, "init_scale": 131072.0, **loss_scaling})
    return make_policy(m, "fp16", {"hot": "fp32"}, loss_scaling=ls)


def fp16_trouble_loop(policy: Policy, steps: int, **controller_kw):
    model = fp16_trouble.build_model()
    x, y = fp16_trouble.sample_batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    handle = pa.apply_policy(model, policy)
    ctl = pa.controller(model, opt, policy, device="cpu", **controller_kw)
    records = []
    for _ in range(steps):
        with pa.autocast(policy, "cpu"):
            loss = F.mse_loss(model(x).float(), y)
        records.append(ctl.step(loss))
    handle.remove()
    return model, ctl, records


def test_twenty_fp16_steps_on_fp16_trouble_stay_finite():
    _, ctl, records = fp16_trouble_loop(audit_policy(), 20)
    losses = [r.loss for r in records]
    assert all(math.isfinite(v) for v in losses), losses
    assert not any(r.skipped for r in records)
    assert losses[-1] < losses[0], "the loop should train"
    s = ctl.monitor.summary()
    assert s["steps"] == 20 and s["skipped_steps"] == 0 and s["nonfinite_modules"] == {}
    assert all(math.isfinite(r.grad_norm) and r.grad_norm > 0 for r in records)


def test_without_the_fp32_pin_fp16_trouble_is_not_finite():
    policy = make_policy(fp16_trouble.build_model(), "fp16", loss_scaling=LossScaling(enabled=True))
    _, ctl, records = fp16_trouble_loop(policy, 3)
    assert all(r.skipped and not math.isfinite(r.loss) for r in records)
    assert "hot" in records[0].nonfinite_modules and ctl.monitor.summary()["skipped_steps"] == 3


class Planted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.mid = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x)))))


def overflow_in_fp16(module, args, output):
    """The planted fault: in fp16 this module's output is scaled past 65504 (in fp32 it is left alone)."""
    return output * 1e6 if output.dtype == torch.float16 else output


def test_adaptive_promotes_a_planted_overflowing_module(caplog, tmp_path):
    model = Planted()
    model.mid.register_forward_hook(overflow_in_fp16)
    policy = make_policy(model, "fp16", loss_scaling=LossScaling(enabled=True, init_scale=1024.0))
    handle = pa.apply_policy(model, policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = pa.controller(model, opt, policy, adaptive=True, device="cpu")
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    caplog.set_level(logging.WARNING, logger="precision_audit")
    records = []
    for _ in range(6):
        with pa.autocast(policy, "cpu"):
            loss = F.mse_loss(model(x).float(), y)
        records.append(ctl.step(loss))
    assert [r.skipped for r in records] == [True] * 3 + [False] * 3
    assert all(r.sources == ("mid",) for r in records[:3]), [r.sources for r in records]
    assert set(records[0].nonfinite_modules) == {"inp", "mid", "out"}  # everything is NaN: attribution matters
    assert records[2].promoted == ("mid",) and not any(r.promoted for r in records[3:])
    assert all(math.isfinite(r.loss) for r in records[3:])
    assert ctl.policy.modules["mid"].format == "fp32" and "adaptive" in ctl.policy.modules["mid"].reason
    assert "mid" not in policy.modules, "the policy passed in is not modified"
    assert handle.modules == {"mid": "fp32"} and handle.policy is ctl.policy, "the user's handle is updated in place"
    assert any("'mid'" in r.message and "fp32" in r.message for r in caplog.records if r.levelno == logging.WARNING)
    assert ctl.monitor.summary()["promotions"] == [{"step": 3, "module": "mid"}]
    out = tmp_path / "policy.json"
    ctl.save_policy(out)
    saved = load_policy(out)
    assert saved.modules["mid"].format == "fp32" and saved.model_fingerprint == policy.model_fingerprint
    handle.remove()
    assert "forward" not in model.mid.__dict__
    ctl.close()


def test_adaptive_without_an_applied_policy_applies_its_copy():
    model = Planted()
    model.mid.register_forward_hook(overflow_in_fp16)
    policy = make_policy(model, "fp16", loss_scaling=LossScaling(enabled=True, init_scale=1024.0))
    ctl = pa.controller(model, torch.optim.SGD(model.parameters(), lr=0.01), policy, adaptive=True, promote_after=2)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    for _ in range(3):
        with pa.autocast(policy, "cpu"):
            rec = ctl.step(F.mse_loss(model(x).float(), y))
    assert not rec.skipped and active_handle(model) is not None
    ctl.close()
    assert active_handle(model) is None and "forward" not in model.mid.__dict__


def test_adaptive_ignores_a_transient_fault_and_backward_overflow_at_a_high_scale():
    model = Planted()
    fault = {"on": True}
    model.mid.register_forward_hook(lambda m, a, o: overflow_in_fp16(m, a, o) if fault["on"] else o)
    # init 2^40: the first steps overflow in backward too (the GradScaler's job, not a module's fault)
    policy = make_policy(model, "fp16", loss_scaling=LossScaling(enabled=True, init_scale=2.0 ** 40))
    ctl = pa.controller(model, torch.optim.SGD(model.parameters(), lr=0.01), policy, adaptive=True)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    records = []
    for i in range(40):
        fault["on"] = i in (0, 1, 5, 6)  # never 3 steps in a row
        with pa.autocast(policy, "cpu"):
            records.append(ctl.step(F.mse_loss(model(x).float(), y)))
    assert not any(r.promoted for r in records) and ctl.policy.modules == {}
    backward_only = [r for i, r in enumerate(records) if r.skipped and i not in (0, 1, 5, 6)]
    assert backward_only, "the high initial scale should overflow in backward"
    assert all(r.sources == () for r in backward_only), [r.sources for r in backward_only]
    assert not records[-1].skipped


def hand_loop(policy: Policy, model: nn.Module, batches) -> list[tuple[float, int, bool]]:
    """The plain torch.amp loop the controller must match."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ls = policy.loss_scaling
    scaler = torch.amp.GradScaler("cpu", init_scale=ls.init_scale, growth_factor=ls.growth_factor,
                                  backoff_factor=ls.backoff_factor, growth_interval=ls.growth_interval)
    states = []
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        before = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        sd = scaler.state_dict()
        states.append((sd["scale"], sd["_growth_tracker"], sd["scale"] < before))
    return states


def test_scaler_state_equals_a_hand_written_amp_loop_step_by_step():
    torch.manual_seed(0)
    model = Planted()
    # a large init scale and growth every 3 clean steps: backoffs and growths both happen
    ls = LossScaling(enabled=True, init_scale=2.0 ** 22, growth_interval=3)
    policy = make_policy(model, "fp16", loss_scaling=ls)
    batches = [(torch.randn(8, 16) * 30, torch.randn(8, 4)) for _ in range(24)]
    reference = copy.deepcopy(model)
    expected = hand_loop(policy, reference, batches)

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ctl = pa.controller(model, opt, policy, device="cpu")
    got = []
    for x, y in batches:
        with pa.autocast(policy, "cpu"):
            rec = ctl.step(F.mse_loss(model(x).float(), y))
        sd = ctl.scaler.state_dict()
        got.append((sd["scale"], sd["_growth_tracker"], rec.skipped))
    assert got == expected
    skipped = [s for _, _, s in expected]
    assert any(skipped) and not all(skipped), "the case must exercise both backoff and growth"
    assert len({s for s, _, _ in expected}) >= 3
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q), "the parameters must match the hand-written loop bit for bit"


def test_controller_on_a_compiled_model():
    model = Net()
    compiled = torch.compile(model, backend="eager")
    policy = make_policy(model, "bf16", {"head": "fp32"})
    handle = pa.apply_policy(compiled, policy)
    ctl = pa.controller(compiled, torch.optim.SGD(compiled.parameters(), lr=0.01), policy, adaptive=True)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    for _ in range(3):
        with pa.autocast(policy, "cpu"):
            rec = ctl.step(F.mse_loss(compiled(x).float(), y))
    assert math.isfinite(rec.loss) and rec.scale is None and not rec.skipped
    assert [n for n, _ in ctl._module_params][0] == "a"
    handle.remove()
    ctl.close()


def test_controller_validates_its_arguments():
    model = Net()
    policy = make_policy(model, "bf16")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(OptionError):
        pa.controller(model, "sgd", policy)
    with pytest.raises(OptionError):
        pa.controller(model, opt, policy, promote_after=0)
    ctl = pa.controller(model, opt, policy)
    with pytest.raises(OptionError, match="one-element tensor"):
        ctl.step(torch.ones(3))
    with pytest.raises(PolicyError, match="another model"):
        pa.controller(Planted(), opt, policy)


def test_max_grad_norm_clips_like_clip_grad_norm():
    torch.manual_seed(1)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    policy = make_policy(a, "fp32")
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    ctl = pa.controller(a, torch.optim.SGD(a.parameters(), lr=0.1), policy, max_grad_norm=0.01)
    ctl.step(F.mse_loss(a(x), y))
    opt = torch.optim.SGD(b.parameters(), lr=0.1)
    F.mse_loss(b(x), y).backward()
    torch.nn.utils.clip_grad_norm_(b.parameters(), 0.01)
    opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)


# -- the monitor -------------------------------------------------------------------------------------------

def test_monitor_detects_loss_spikes_against_the_running_median(caplog):
    mon = StabilityMonitor(spike_window=5, spike_factor=3.0, min_history=3)
    losses = [1.0, 1.1, 0.9, 5.0, 1.0, float("nan"), 2.9, 3.5, 1.0]
    caplog.set_level(logging.INFO, logger="precision_audit")
    recs = [mon.observe(step=i + 1, loss=v, scale=None, skipped=False, grad_norm=1.0) for i, v in enumerate(losses)]
    assert [r.loss_spike for r in recs] == [False, False, False, True, False, False, False, True, False]
    s = mon.summary()
    assert s["loss_spikes"] == 2 and s["nonfinite_loss_steps"] == 1 and s["steps"] == 9
    assert any("loss spike" in r.message for r in caplog.records)
    assert recs[3].to_dict()["loss_spike"] is True


def test_a_loss_with_a_reward_term_spikes_against_its_noise_not_its_median():
    """Issue 32: a loss that can be negative (-0.05 + noise of 0.2: a reward term) has a median whose size means
    nothing; against ``median + 2 x |median|`` a third of its ordinary steps read as spikes. Judged against its own
    spread, none do, and a planted jump of 3.0 (15 standard deviations) does."""
    g = torch.Generator().manual_seed(0)
    losses = (-0.05 + 0.2 * torch.randn(300, generator=g, dtype=torch.float64)).tolist()
    losses[200] = 3.0
    for offset in (0.0, -3.0):  # near zero, and a negative median of some size: the rule is the same
        mon = StabilityMonitor()
        recs = [mon.observe(step=i + 1, loss=v + offset, scale=None, skipped=False, grad_norm=1.0)
                for i, v in enumerate(losses)]
        assert [r.step for r in recs if r.loss_spike] == [201], offset
    # an ordinary positive loss keeps the multiplicative rule: 3x its median (0.1% noise)
    mon = StabilityMonitor()
    steady = [2.0 * (1 + 1e-3 * v) for v in torch.randn(60, generator=g, dtype=torch.float64).tolist()]
    recs = [mon.observe(step=i + 1, loss=v, scale=None, skipped=False, grad_norm=1.0)
            for i, v in enumerate(steady + [5.9, 6.1])]
    assert [r.loss_spike for r in recs[-2:]] == [False, True]


def test_monitor_history_is_bounded_but_counts_are_not():
    mon = StabilityMonitor(history_limit=3)
    for i in range(10):
        mon.observe(step=i + 1, loss=1.0, scale=2.0, skipped=i % 2 == 0, grad_norm=float(i),
                    nonfinite_modules=("a",) if i % 2 == 0 else ())
    assert [r.step for r in mon.history] == [8, 9, 10]
    s = mon.summary()
    assert s["skipped_steps"] == 5 and s["nonfinite_modules"] == {"a": 5} and s["max_grad_norm"] == 9.0
    with pytest.raises(OptionError):
        StabilityMonitor(spike_factor=1.0)
