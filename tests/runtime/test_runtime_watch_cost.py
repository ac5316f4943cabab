"""Issue 36, the watch's cost: what a watched step adds and what the other steps do not pay.

- The forecast of every watched series is fitted together (runtime/forecast.py, ``fit_crossings``: numpy, the
  prediction interval in closed form); it must give what the straightforward fit gives: the pure-Python
  Theil-Sen and bisection below (the implementation before the batched one), on random series with gaps,
  falling series and flat noise.
- The watch's hooks are installed for the watched steps only: an unwatched step runs exactly the operators of a
  controller without the watch, and the model holds no hook of the watch's then.
- A watched step adds two reductions per watched module (its output's and its output gradient's extremes) and a
  fixed handful for all of them together (the stack, the max), whatever the number of modules.
- Under torch.compile (dynamo's tracing, the aot_eager backend) the watch records what it records eagerly.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import precision_audit as pa
from precision_audit.policy import LossScaling, Policy, fingerprint, model_layout
from precision_audit.runtime.forecast import Z, fit_crossing, fit_crossings
from tests.runtime.test_runtime_step_cost import Count


def _reference_fit(steps, values, *, limit, now, horizon, rising=True):
    """The fit written out plainly: statistics.median, the band's crossings by bisection."""
    pts = [(float(s), float(v)) for s, v in zip(steps, values) if math.isfinite(v)]
    if len(pts) < 6:
        return None
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    if not rising:
        ys, limit = [-y for y in ys], -limit
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))
              if xs[j] != xs[i]]
    slope = statistics.median(slopes) if slopes else 0.0
    intercept = statistics.median(y - slope * x for x, y in zip(xs, ys))
    n = len(xs)
    mean_x = sum(xs) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx <= 0:
        return None
    sigma = 1.4826 * statistics.median(abs(y - (intercept + slope * x)) for x, y in zip(xs, ys))
    sigma = max(sigma, 1e-6 * max(1.0, max(abs(y) for y in ys)))

    def pred_sd(s):
        return sigma * math.sqrt(1.0 + 1.0 / n + (s - mean_x) ** 2 / sxx)

    ahead = now + horizon
    conf = 0.5 * (1.0 + math.erf((intercept + slope * ahead - limit) / pred_sd(ahead) / math.sqrt(2.0)))
    sign = 1 if rising else -1
    if slope <= Z * sigma / math.sqrt(sxx):
        return (sign * slope, sign * intercept, sigma, None, None, None, conf, n)
    step = (limit - intercept) / slope
    low = _bisect(lambda s: intercept + slope * s + Z * pred_sd(s) - limit, now if step > now else step, step)
    high = _bisect(lambda s: intercept + slope * s - Z * pred_sd(s) - limit, step, step + 50 * (step - mean_x + 1))
    return (sign * slope, sign * intercept, sigma, step, low, high, conf, n)


def _bisect(fn: Callable[[float], float], a: float, b: float) -> float | None:
    if fn(a) > 0:
        return a
    if fn(b) < 0:
        return None
    for _ in range(200):
        m = 0.5 * (a + b)
        a, b = (m, b) if fn(m) < 0 else (a, m)
    return 0.5 * (a + b)


def _random_series(rng: random.Random) -> tuple[list[float], list[float], float, bool, float]:
    n = rng.randint(2, 32)
    start = rng.randint(1, 2000)
    steps = [start + 10 * i for i in range(n)]
    slope = rng.choice([0.0, rng.uniform(-0.05, 0.05), rng.uniform(0.001, 0.03)])
    noise = rng.choice([0.0, 0.01, 0.3, 2.0])
    values = [rng.uniform(-5, 5) + slope * s + rng.gauss(0, noise) if noise else slope * s for s in steps]
    for i in range(n):
        if rng.random() < 0.1:
            values[i] = rng.choice([math.nan, math.inf, -math.inf])
    rising = rng.random() < 0.8
    limit = (max((v for v in values if math.isfinite(v)), default=0.0) + rng.uniform(0.5, 20) if rising
             else min((v for v in values if math.isfinite(v)), default=0.0) - rng.uniform(0.5, 20))
    return steps, values, limit, rising, steps[-1]


def test_the_batched_fit_gives_the_plain_fits_answers():
    rng = random.Random(36)
    cases = [_random_series(rng) for _ in range(400)]
    crossings = 0
    for chunk in range(0, len(cases), 37):  # batches of mixed lengths, as the watch fits them
        batch = cases[chunk:chunk + 37]
        got = fit_crossings([(s, v, lim, up) for s, v, lim, up, _ in batch], now=batch[0][4], horizon=200)
        for (s, v, lim, up, _), fc in zip(batch, got):
            ref = _reference_fit(s, v, limit=lim, now=batch[0][4], horizon=200, rising=up)
            single = fit_crossing(s, v, limit=lim, now=batch[0][4], horizon=200, rising=up)
            if ref is None:
                assert fc is None and single is None
                continue
            for one in (fc, single):  # in a batch (padded to the longest series) and alone
                mine = (one.slope, one.intercept, one.sigma, one.step, one.low, one.high, one.confidence, one.points)
                for a, b in zip(mine, ref):
                    assert (a is None) == (b is None), (mine, ref)
                    if a is not None:
                        assert a == pytest.approx(b, rel=1e-9, abs=1e-9), (mine, ref)
            crossings += fc.step is not None and fc.high is not None
    assert crossings >= 50, "the cases should exercise the interval's both ends"


# -- the device side -------------------------------------------------------------------------------------------

class Deep(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(depth))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def _policy(model: nn.Module, default: str) -> Policy:
    fp, n = fingerprint(model)
    return Policy(model_class=type(model).__name__, model_fingerprint=fp, model_modules=n, target_name="test",
                  target_compute_capability=(9, 0), default_format=default,
                  loss_scaling=LossScaling(enabled=default == "fp16", init_scale=256.0),
                  model_layout=model_layout(model))


def _ops_per_step(depth: int, default: str, **watch) -> list[dict[str, int]]:
    """Operators dispatched by each of steps 1-4 of a controller (with ``watch`` options)."""
    torch.manual_seed(0)
    model = Deep(depth)
    policy = _policy(model, default)
    ctl = pa.controller(model, torch.optim.SGD(model.parameters(), lr=0.01), policy, device="cpu", **watch)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    counts = []
    hooked = []
    for _ in range(4):
        hooked.append(sum(len(m._forward_hooks) for m in model.modules()))
        with Count() as c:
            with pa.autocast(policy, "cpu"):
                loss = F.mse_loss(model(x).float(), y)
            ctl.step(loss)
        counts.append(dict(c.ops))
    ctl.close()
    return counts, hooked


def test_unwatched_steps_run_no_code_of_the_watch():
    plain, plain_hooks = _ops_per_step(3, "bf16")
    watched, hooks = _ops_per_step(3, "bf16", watch=True, watch_every=2)
    assert watched[1] == plain[1] and watched[3] == plain[3]  # steps 2 and 4: not watched
    # the watch's forward hooks (one per watched module: 4) are on the model for steps 1 and 3 only
    assert [h - p for h, p in zip(hooks, plain_hooks)] == [4, 0, 4, 0]


@pytest.mark.parametrize("default", ["bf16", "fp16"])
def test_a_watched_step_adds_two_reductions_per_module_and_a_fixed_few(default):
    added = {}
    for depth in (2, 6):
        plain, _ = _ops_per_step(depth, default)
        watched, _ = _ops_per_step(depth, default, watch=True, watch_every=2)
        extra = {k: watched[0].get(k, 0) - plain[0].get(k, 0) for k in set(watched[0]) | set(plain[0])}
        added[depth] = {k: v for k, v in extra.items() if v}
    per_module = {k: (added[6].get(k, 0) - added[2].get(k, 0)) / 4 for k in set(added[6]) | set(added[2])}
    per_module = {k: v for k, v in per_module.items() if v}
    if default == "bf16":  # the output's and the gradient's extremes, one kernel each
        assert per_module == {"aminmax": 2}, per_module
    else:  # fp16 gradients: |g|, its max and the count of values below the normal range (lt, gt, and, sum)
        assert per_module == {"aminmax": 1, "abs": 1, "max": 1, "lt": 1, "gt": 1, "bitwise_and": 1, "sum": 1}, \
            per_module
    fixed = sum(added[2].values()) - 2 * sum(per_module.values()) * 3  # 3 watched modules at depth 2
    assert fixed <= 8, added[2]


def _watched_series(compiled: bool) -> dict:
    torch.manual_seed(0)
    model = Deep(2)
    policy = _policy(model, "bf16")
    m = torch.compile(model, backend="aot_eager") if compiled else model  # dynamo's tracing, no code generation
    handle = pa.apply_policy(m, policy)
    ctl = pa.controller(m, torch.optim.SGD(model.parameters(), lr=0.01), policy, watch=True, watch_every=2,
                        device="cpu")
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        with pa.autocast(policy, "cpu"):
            loss = F.mse_loss(m(x).float(), y)
        ctl.step(loss)
    handle.remove()
    ctl.close()
    return {name: {k: [v if math.isfinite(v) else str(v) for v in vals] for k, vals in s.items()}
            for name, s in ctl.watch.series.items()}


def test_the_watch_under_torch_compile_records_what_eager_records():
    # the hooks come and go with the watched steps: dynamo traces both variants (a recompile, then cached)
    eager, compiled = _watched_series(False), _watched_series(True)
    assert list(eager["head"]["step"]) == [1, 3, 5]
    assert compiled == eager
