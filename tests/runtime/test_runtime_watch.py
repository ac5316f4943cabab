"""Issue 36: the watch (per-module amax and fp16 underflow over a run), its forecast, and the action before the
first overflow.

The planted case is sample_models/fp16_growth: a regression whose targets grow by a fixed factor per step, so
that ``head``'s output grows with them. Measured by running it (SGD lr 0.2, growth 1.02 per step, 600 steps, the
FP16 policy with loss scaling from 1): without the watch the first skipped step is T = 526 (head's output passes
65504), with 3 skipped steps and the reactive promotion at 528; with the watch, ``head`` is promoted to bf16 at
step 331 on a forecast of 525 and no step is skipped (test_the_growth_sample_over_600_steps, marked slow). The fast
variant grows 1.08 per step over 160 steps.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import precision_audit as pa
from precision_audit import load_policy
from precision_audit.errors import OptionError
from precision_audit.policy import LossScaling, Policy, fingerprint, model_layout
from precision_audit.runtime.forecast import fit_crossing, theil_sen
from tests.runtime.test_runtime_step_cost import Count

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())


def _load_sample(name: str):
    """A sample's model.py under its own module name (other tests import theirs as ``model``)."""
    spec = importlib.util.spec_from_file_location(f"sample_{name}", ROOT / "sample_models" / name / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


growth = _load_sample("fp16_growth")


def make_policy(model: nn.Module, default: str, *, cc: tuple[int, int] | None = (9, 0), scaling: bool = True,
                init_scale: float = 1.0) -> Policy:
    fp, n = fingerprint(model)
    return Policy(model_class=type(model).__name__, model_fingerprint=fp, model_modules=n, target_name="test",
                  target_compute_capability=cc, default_format=default,
                  loss_scaling=LossScaling(enabled=scaling and default == "fp16", init_scale=init_scale),
                  model_layout=model_layout(model))


# -- the forecast ------------------------------------------------------------------------------------------------

def test_an_exact_line_crosses_where_algebra_says():
    fc = fit_crossing([10, 20, 30, 40, 50, 60], [1, 2, 3, 4, 5, 6], limit=16.0, now=60, horizon=200)
    assert fc is not None and fc.step == pytest.approx(160.0) and fc.low <= 160.0 <= fc.high
    assert fc.confidence > 0.999  # 160 is within now + 200
    late = fit_crossing([10, 20, 30, 40, 50, 60], [1, 2, 3, 4, 5, 6], limit=16.0, now=60, horizon=50)
    assert late is not None and late.confidence < 1e-3  # 160 is not within 60 + 50


def test_a_noisy_trend_is_bracketed_and_flat_noise_never_crosses():
    rng = random.Random(0)
    hits = 0
    for _ in range(40):
        xs = list(range(0, 400, 10))
        ys = [0.02 * x + rng.gauss(0, 0.3) for x in xs]
        fc = fit_crossing(xs, ys, limit=16.0, now=390, horizon=200)
        assert fc is not None and fc.step is not None
        hits += fc.low <= 800.0 <= fc.high  # the true line meets 16 at step 800
    assert hits >= 34, f"the 95% interval held the truth in only {hits}/40 trials"
    for _ in range(20):
        xs = list(range(0, 400, 10))
        fc = fit_crossing(xs, [rng.gauss(0, 0.3) for _ in xs], limit=16.0, now=390, horizon=200)
        # no trend: no crossing, or (a chance slope, 2.5% of flat series) one far beyond the horizon; never acted on
        assert fc is not None and fc.confidence < 1e-6
        assert fc.step is None or fc.step - 390 > 10 * 200, fc


def test_the_fit_is_robust_to_outlying_readings_and_mirrors_for_a_floor():
    xs = list(range(20))
    ys = [0.5 * x for x in xs]
    ys[7], ys[15] = 100.0, -50.0  # two wild readings (a loss spike)
    assert theil_sen(xs, ys)[0] == pytest.approx(0.5)
    fc = fit_crossing(xs, [10 - 0.5 * x for x in xs], limit=-5.0, now=19, horizon=50, rising=False)
    assert fc is not None and fc.step == pytest.approx(30.0) and fc.slope == pytest.approx(-0.5)
    assert fit_crossing([1, 2, 3], [1, 2, 3], limit=9, now=3, horizon=9) is None  # too few readings


# -- the recording -----------------------------------------------------------------------------------------------

class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _small_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A loss whose gradients land in fp16's subnormal range at a loss scale of 4."""
    return F.mse_loss(out.float(), y) * 1e-4


def _reference(model: Net, policy: Policy, x: torch.Tensor, y: torch.Tensor, scale: float) -> dict[str, tuple]:
    """Brute force on a copy: each module's output amax, unscaled output-gradient amax and fp16 subnormal share."""
    import copy

    m = copy.deepcopy(model)
    outs = {}
    for name in ("a", "b"):
        getattr(m, name).register_forward_hook(lambda mod, i, o, name=name: outs.__setitem__(name, o))
    with pa.apply_policy(m, policy), pa.autocast(policy, "cpu"):
        out = m(x)
        for o in outs.values():
            o.retain_grad()
        (_small_loss(out, y) * scale).backward()
    ref = {}
    for name, o in outs.items():
        g = o.grad
        small = ((g.abs() < 2.0 ** -14) & (g != 0)).sum().item() / g.numel()
        ref[name] = (o.detach().float().abs().max().item(), g.float().abs().max().item() / scale, small)
    return ref


def test_the_watch_records_what_brute_force_measures_every_nth_step():
    torch.manual_seed(0)
    model = Net()
    policy = make_policy(model, "fp16", init_scale=4.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = pa.controller(model, opt, policy, watch=True, watch_every=3, device="cpu")
    handle = pa.apply_policy(model, policy)
    for step in range(1, 8):
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        handle.remove()
        ref = _reference(model, policy, x, y, ctl.scaler.get_scale())
        handle = pa.apply_policy(model, policy)
        with pa.autocast(policy, "cpu"):
            loss = _small_loss(model(x), y)
        ctl.step(loss)
        s = ctl.watch.series
        if step in (1, 4, 7):
            for name in ("a", "b"):
                assert s[name]["step"][-1] == step
                got = (s[name]["output"][-1], s[name]["gradient"][-1], s[name]["underflow"][-1])
                assert got == pytest.approx(ref[name], rel=1e-6, abs=1e-12), (step, name, got, ref[name])
    assert list(ctl.watch.series["a"]["step"]) == [1, 4, 7]
    assert any(v > 0 for v in ctl.watch.series["a"]["underflow"]), "the case should have subnormal gradients"
    handle.remove()
    ctl.close()


def test_a_watched_step_still_reads_the_device_once():
    torch.manual_seed(0)
    model = Net()
    policy = make_policy(model, "fp16", init_scale=256.0)
    ctl = pa.controller(model, torch.optim.SGD(model.parameters(), lr=0.01), policy, watch=True, watch_every=1,
                        device="cpu")
    x, y = torch.randn(8, 16), torch.randn(8, 4)

    def step():
        with pa.autocast(policy, "cpu"):
            loss = F.mse_loss(model(x).float(), y)
        ctl.step(loss)

    step()
    with Count() as c:
        step()
    assert c.syncs == 1 and c.from_host == 0, (c.syncs, c.from_host)
    assert ctl.watch.readings == 2
    ctl.close()


def test_watch_options_are_checked():
    model = Net()
    policy = make_policy(model, "bf16")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for kw in ({"watch": "yes"}, {"watch": True, "watch_every": 0}, {"watch": True, "horizon": -1},
               {"watch": True, "min_confidence": 1.0}, {"watch": True, "watch_writer": object()}):
        with pytest.raises(OptionError):
            pa.controller(model, opt, policy, **kw)
    with pytest.raises(OptionError, match="watch=True"):
        pa.controller(model, opt, policy).save_watch("x.json")


# -- the planted growth ----------------------------------------------------------------------------------------

def _train(default: str, steps: int, g: float, *, watch: bool, adaptive: bool, **kw) -> tuple:
    model = growth.build_model()
    policy = make_policy(model, default)
    handle = pa.apply_policy(model, policy)
    ctl = pa.controller(model, torch.optim.SGD(model.parameters(), lr=0.2), policy, watch=watch, adaptive=adaptive,
                        device="cpu", **kw)
    first_skip = None
    for t in range(1, steps + 1):
        x, y = growth.batch_at(t, g)
        with pa.autocast(policy, "cpu"):
            loss = F.mse_loss(model(x).float(), y)
        rec = ctl.step(loss)
        if rec.skipped and first_skip is None:
            first_skip = t
    handle.remove()
    ctl.close()
    return ctl, first_skip, rec.loss


def _check_growth(steps: int, g: float, tmp_path: Path, **kw) -> None:
    ref, _, loss32 = _train("fp32", steps, g, watch=False, adaptive=False)
    plain, t_first, _ = _train("fp16", steps, g, watch=False, adaptive=True)
    assert t_first is not None and plain.skipped_steps >= 1, "the planted growth must overflow fp16"
    promotions = plain.monitor.summary()["promotions"]
    assert promotions and promotions[0]["module"] == "head" and promotions[0]["step"] >= t_first
    watched, first, loss16 = _train("fp16", steps, g, watch=True, adaptive=True, **kw)
    assert first is None and watched.skipped_steps == 0
    acts = watched.watch.actions
    assert [(a.module, a.kind, a.change) for a in acts] == [("head", "promote", "fp16 -> bf16")]
    assert acts[0].step < t_first and watched.policy.modules["head"].format == "bf16"
    assert "forecast to pass fp16's largest value 65504" in watched.policy.modules["head"].reason
    # the forecast made 100 steps before T (the last reading at or before it) names head, within 15% of T
    before = [e for e in watched.watch.log if e["at"] <= t_first - 100 and e["kind"] == "activation"
              and e["format"] == "fp16"]
    assert before and before[-1]["module"] == "head", before[-3:]
    assert abs(before[-1]["step"] - t_first) <= 0.15 * t_first, (before[-1], t_first)
    assert not [e for e in watched.watch.log if e["module"] != "head"], "no other module approaches a limit"
    assert abs(loss16 - loss32) / abs(loss32) <= 1e-2, (loss16, loss32)  # the default loss budget
    out = tmp_path / "policy.adapted.json"
    watched.save_policy(out)
    saved = load_policy(out)
    assert saved.modules["head"].format == "bf16" and saved.extra["watch"]["actions"][0]["module"] == "head"
    watched.save_watch(tmp_path / "watch.json")
    log = json.loads((tmp_path / "watch.json").read_text())
    assert log["schema"] == "precision-audit/watch" and log["modules"]["head"]["step"][0] == 1


def test_the_growth_sample_fast(tmp_path):
    _check_growth(160, 1.08, tmp_path, watch_every=2, horizon=50)


@pytest.mark.slow
def test_the_growth_sample_over_600_steps(tmp_path):
    _check_growth(600, growth.GROWTH, tmp_path)


# -- the planted underflow ---------------------------------------------------------------------------------------

class Shrink(nn.Module):
    """Trained with a loss weight decaying 4% a step at a fixed loss scale of 1024: its fp16 output gradients
    shrink into the subnormal range. Measured by running it (every step read, no action): the share below 2^-14
    first passes 1% at step 124 in ``a`` and 118 in ``b``; no step is skipped (an underflow never skips)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(64, 32)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _shrink_run(every: int, act: bool, steps: int = 200, writer=None):
    torch.manual_seed(0)
    model = Shrink()
    policy = make_policy(model, "fp16")
    policy = Policy(**{**policy.__dict__, "loss_scaling": LossScaling(enabled=True, init_scale=1024.0,
                                                                      growth_interval=10 ** 6)})
    handle = pa.apply_policy(model, policy)
    ctl = pa.controller(model, torch.optim.SGD(model.parameters(), lr=0.01), policy, watch=True, watch_every=every,
                        horizon=100, device="cpu", watch_writer=writer)
    if not act:
        ctl.watch.min_confidence = math.inf  # measure only: never act
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 32, generator=g)
    for t in range(1, steps + 1):
        with pa.autocast(policy, "cpu"):
            loss = F.mse_loss(model(x).float(), y) * 0.96 ** t
        ctl.step(loss)
    handle.remove()
    ctl.close()
    return ctl


def test_shrinking_gradients_are_promoted_before_they_underflow(tmp_path):
    plain = _shrink_run(1, act=False, steps=130)
    crossing = {n: next(s for s, u in zip(plain.watch.series[n]["step"], plain.watch.series[n]["underflow"])
                        if u > 0.01) for n in ("a", "b")}
    assert plain.skipped_steps == 0 and not plain.watch.actions
    assert 100 < min(crossing.values()), crossing  # the planted trend, not the start, crosses
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    watched = _shrink_run(5, act=True, steps=130, writer=writer)
    writer.close()
    acts = {a.module: a for a in watched.watch.actions}
    assert set(acts) == {"a", "b"} and all(acts[n].step < crossing[n] for n in acts), (acts, crossing)
    assert all("below the normal range" in a.reason and a.change == "fp16 -> bf16" for a in acts.values())
    # the series went to TensorBoard on the step axis
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    events = ea.Scalars("watch/a/output_amax_log2")
    assert [e.step for e in events] == list(watched.watch.series["a"]["step"])
    assert events[0].value == pytest.approx(math.log2(watched.watch.series["a"]["output"][0]), rel=1e-6)


# -- no false alarms --------------------------------------------------------------------------------------------

def test_no_forecast_on_a_steady_sample():
    """The mlp sample trained 100 steps on random data in fp16: no action, and no forecast puts a crossing within
    the horizon (bench/watch_false_alarms.py runs the other samples and two Hugging Face models, 300 steps)."""
    model = _load_sample("mlp").build_model()
    policy = make_policy(model, "fp16", init_scale=2.0 ** 16)
    handle = pa.apply_policy(model, policy)
    ctl = pa.controller(model, torch.optim.Adam(model.parameters(), lr=1e-3), policy, watch=True, watch_every=5,
                        device="cpu")
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 16, (32,), generator=g)
        with pa.autocast(policy, "cpu"):
            loss = F.cross_entropy(model(x).float(), y)
        ctl.step(loss)
    handle.remove()
    ctl.close()
    assert ctl.watch.readings == 20 and ctl.skipped_steps == 0
    assert ctl.watch.actions == []
    assert all(e["step"] - e["at"] > 200 for e in ctl.watch.log), ctl.watch.log


# -- the loss scale ----------------------------------------------------------------------------------------------

def _rising_grads(watch: bool, steps: int = 150):
    """Net trained in fp16 with a loss weight growing 4% a step at a fixed loss scale of 2^12 (growth interval
    10^6): the scaled gradients grow towards fp16's 65504, and the GradScaler would back off on an overflow."""
    torch.manual_seed(0)
    model = Net()
    base = make_policy(model, "fp16")
    policy = Policy(**{**base.__dict__, "loss_scaling": LossScaling(enabled=True, init_scale=2.0 ** 12,
                                                                    growth_interval=10 ** 6)})
    handle = pa.apply_policy(model, policy)
    ctl = pa.controller(model, torch.optim.SGD(model.parameters(), lr=1e-9), policy, watch=watch, watch_every=5,
                        horizon=100, device="cpu")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)
    first = None
    for t in range(1, steps + 1):
        with pa.autocast(policy, "cpu"):
            loss = F.mse_loss(model(x).float(), y) * 1.04 ** t
        if ctl.step(loss).skipped and first is None:
            first = t
    handle.remove()
    ctl.close()
    return ctl, first


def test_rising_gradients_lower_the_loss_scale_before_the_first_overflow():
    plain, first = _rising_grads(False)
    assert first is not None and plain.skipped_steps >= 1, "the planted growth must overflow the scaled gradients"
    watched, first_w = _rising_grads(True)
    assert first_w is None and watched.skipped_steps == 0
    acts = [a for a in watched.watch.actions if a.kind == "loss_scale"]
    assert acts and acts[0].step < first, (acts[:1], first)
    assert "scaled output-gradient amax" in acts[0].reason and "growth interval 1000000 -> 4000000" in acts[0].change
    assert all(a.change == "scale x0.5" for a in acts[1:]), "the growth slows once; later actions back off"
    assert watched.policy.loss_scaling.growth_interval == 4 * 10 ** 6
    assert watched.scaler.get_scale() == 2.0 ** 12 * 0.5 ** len(acts)
