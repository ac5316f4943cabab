"""The watch: per-module headroom over a training run, its forecast, and the action taken before the limit
(docs/policy.md, "Watch and forecast").

``controller(..., watch=True)`` makes a :class:`Watch`. On every ``watch_every``-th step (the first step, then
every N-th) a forward hook on each watched module (every module with parameters of its own) takes the amax of
its output (one ``torch.aminmax`` kernel, its two 0-d results kept on the device: the running extremes over the
step's calls) and a tensor hook on that output takes the amax of the gradient arriving there and, for a module in
fp16, how many of the gradient's elements are nonzero but below fp16's normal range (2^-14): the share that
keeps fewer bits at the current loss scale (the gradient in backward is the scaled one). Nothing is read in the
hooks. The controller puts the stacked values into the step's one device read (runtime/readout.py), so a watched
step costs those kernels and no extra synchronisation. The hooks are installed for the watched steps only: the
other steps run none of the watch's code.

Each reading is added to a compact per-module series (the last ``history`` readings: step, output amax, unscaled
gradient amax, fp16 underflow share) and, with a ``writer`` (a ``torch.utils.tensorboard.SummaryWriter``),
written as TensorBoard scalars on the step axis. Then the forecast (runtime/forecast.py) is refreshed, per
module and per format it runs in (or ran in before a promotion):

- ``activation``: log2 of the output amax against log2 of the format's largest finite value;
- ``gradient``: log2 of the scaled gradient amax (unscaled amax x the current loss scale) against fp16's
  largest value, for fp16 modules under a GradScaler;
- ``underflow``: the fp16 underflow share against :data:`UNDERFLOW_LIMIT`.

When a forecast puts the crossing within ``horizon`` steps with at least ``min_confidence``, the watch acts: an
fp16 module overflowing or underflowing is promoted to bf16 when the policy's target has it (compute capability
8.0 or later), else to fp32; a bf16 module to fp32; a scaled gradient heading for fp16's maximum lowers the
loss scale (one backoff) and, the first time, slows its growth (the growth interval x4). The reason quotes the
forecast; the controller records it in its copy of the policy (``controller.policy``) and logs it at WARNING.

Example::

    ctl = pa.controller(model, optimizer, policy, watch=True, watch_every=10, horizon=200)
    ...
    ctl.watch.forecasts[("head", "fp16", "activation")].step   # the step the head's output would pass 65504
    ctl.save_watch("run/watch.json")                             # the series, forecasts and actions
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import OptionError
from ..formats import SPECS, Format
from ..policy import Policy
from . import watch_fp8
from .forecast import Crossing, fit_crossings

log = logging.getLogger(__name__)

#: The share of an fp16 gradient's elements below the normal range that counts as an underflow problem: the
#: audit's own threshold for a viable loss scale (docs/policy.md, "Watch and forecast").
UNDERFLOW_LIMIT = 1e-2
#: fp16's smallest normal value: gradient elements below it (and nonzero) are subnormal at the loss scale used.
FP16_NORMAL = 2.0 ** -14
#: Readings a forecast fits (the recent trend).
DEFAULT_WINDOW = 32
#: The fewest readings a forecast must fit before the watch acts on it (a shorter series is forecast and logged):
#: six noisy readings can show a slope that is not there (docs/policy.md, "Watch and forecast").
ACT_MIN_POINTS = 10
#: Forecast records kept (each a crossing within this many horizons).
LOG_HORIZONS = 5
_PROMOTE = {"fp16": "bf16", "bf16": "fp32"}
#: Each module's series; and those of a module planned ``fp8_delayed``
_KEYS = ("step", "output", "gradient", "underflow")
_FP8_KEYS = ("fp8_input", "fp8_weight")


def format_max(fmt: str) -> float | None:
    """The largest finite value of a low-precision format (None for fp32 / tf32: not watched)."""
    if fmt in ("fp32", "tf32"):
        return None
    return float(SPECS[Format(fmt)].max)


@dataclass(frozen=True)
class Action:
    """What the watch changed, at which step, and why (the forecast quoted)."""

    step: int
    module: str
    kind: str  # "promote" | "loss_scale" | "fp8_recipe"
    change: str  # e.g. "fp16 -> bf16", "scale x0.5, growth interval 2000 -> 8000", "fp8_delayed -> fp8_rowwise"
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "module": self.module, "kind": self.kind, "change": self.change,
                "reason": self.reason}


class Watch:
    """The per-module recorder, forecaster and planner of actions (module docstring)."""

    def __init__(self, modules: list[tuple[str, torch.nn.Module]], *, every: int = 10, horizon: int = 200,
                 min_confidence: float = 0.9, window: int = DEFAULT_WINDOW, history: int = 1000,
                 writer: Any = None, fp8_delayed: Collection[str] = ()) -> None:
        if not (isinstance(every, int) and not isinstance(every, bool) and every >= 1):
            raise OptionError("watch_every must be an integer >= 1", found=repr(every))
        if not (isinstance(horizon, int) and not isinstance(horizon, bool) and horizon >= 1):
            raise OptionError("horizon must be an integer number of steps >= 1", found=repr(horizon))
        if not (isinstance(min_confidence, (int, float)) and 0 < min_confidence < 1):
            raise OptionError("min_confidence must be a probability strictly between 0 and 1",
                              found=repr(min_confidence))
        if writer is not None and not callable(getattr(writer, "add_scalar", None)):
            raise OptionError("watch_writer must have add_scalar(tag, value, step) (a SummaryWriter)",
                              found=type(writer).__name__)
        self.every, self.horizon, self.min_confidence, self.window = every, horizon, float(min_confidence), window
        self.writer = writer
        self.names = [n for n, m in modules if any(True for _ in m.parameters(recurse=False))]
        index = {n: i for i, n in enumerate(self.names)}
        self._watched = [(index[n], m) for n, m in modules if n in index]
        # modules the policy's FP8 plan puts under delayed scaling: their input and weight amaxes too
        # (runtime/watch_fp8.py)
        self.fp8 = [n for n in self.names if n in set(fp8_delayed)]
        self._fp8_at = {index[n]: f for f, n in enumerate(self.fp8)}
        # per module, 0-d device tensors: the largest and smallest output values (amax = max(hi, -lo)), the same
        # of the output gradient, the count of its fp16 values below the normal range
        self._hi: list[torch.Tensor | None] = []
        self._lo: list[torch.Tensor | None] = []
        self._small: list[torch.Tensor | None] = []
        self._total: list[int] = []
        self.clear()
        self._handles: list[Any] = []
        self._armed = False
        self.arm(1)  # step 1 is read
        self.series: dict[str, dict[str, collections.deque[float]]] = {
            n: {k: collections.deque(maxlen=history) for k in _KEYS + (_FP8_KEYS if n in self.fp8 else ())}
            for n in self.names}
        self.ran_in: dict[str, list[str]] = {n: [] for n in self.names}  # formats seen, in order
        self.forecasts: dict[tuple[str, str, str], Crossing] = {}
        self.log: list[dict[str, Any]] = []
        self.actions: list[Action] = []
        self.readings = 0

    # -- recording (device side) -----------------------------------------------------------------------------

    def _forward_hook(self, k: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            if not torch.is_grad_enabled():
                return
            f = self._fp8_at.get(k)
            if f is not None:
                self._fp8_reads(f, module, args)
            t = _first_float(out)
            if t is None or not t.numel():
                return
            # one reduction kernel (torch.aminmax) per call, its two 0-d results kept on the device; the
            # amax is max(hi, -lo), taken for every module at once when the step is read (:meth:`pending`).
            # (On a CPU vector_norm(inf) is an unvectorised loop, ~20x slower than aminmax: bench/README.md.)
            lo, hi = torch.aminmax(t.detach())
            self._keep(k, hi, lo)
            if t.requires_grad:
                t.register_hook(self._grad_hook(len(self.names) + k))
        return hook

    def _fp8_reads(self, f: int, module: torch.nn.Module, args: Any) -> None:
        """The input's and the weight's extremes of a module planned ``fp8_delayed`` (the recipe scales both)."""
        m, nf = len(self.names), len(self.fp8)
        x, w = _first_float(args), getattr(module, "weight", None)
        for j, t in ((2 * m + f, x), (2 * m + nf + f, w)):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                lo, hi = torch.aminmax(t.detach())
                self._keep(j, hi, lo)

    def _keep(self, j: int, hi: torch.Tensor, lo: torch.Tensor) -> None:
        prev_hi, prev_lo = self._hi[j], self._lo[j]
        if prev_hi is None or prev_lo is None:
            self._hi[j], self._lo[j] = hi, lo
        else:  # a module called again in the step: the running extremes
            self._hi[j], self._lo[j] = torch.maximum(prev_hi, hi), torch.minimum(prev_lo, lo)

    def _grad_hook(self, j: int) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:
            if not g.numel():
                return
            if g.dtype != torch.float16:
                lo, hi = torch.aminmax(g)
                self._keep(j, hi, lo)
                return
            a = g.abs()  # needed for the count anyway: its max is the amax (and -lo = -hi never exceeds it)
            amax = a.max()
            self._keep(j, amax, amax)
            k = j - len(self.names)
            small = ((a < FP16_NORMAL) & (a > 0)).sum()
            prev = self._small[k]
            self._small[k] = small if prev is None else prev + small
            self._total[k] += g.numel()
        return hook

    def arm(self, next_step: int) -> None:
        """Arm the hooks for ``next_step`` (1-based) when it is a watched step (the first, then every N-th): they
        are installed for that step only, so that the other steps run no hook of the watch's at all."""
        armed = (next_step - 1) % self.every == 0
        if armed and not self._handles:
            self._hook()
        elif not armed:
            self._unhook()
        self._armed = armed

    def _hook(self) -> None:
        self._handles = [m.register_forward_hook(self._forward_hook(k)) for k, m in self._watched]

    def _unhook(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def armed(self) -> bool:
        return self._armed

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No hook of the watch's inside (a re-audit's own forward passes); armed as before after."""
        armed = self._armed
        self._unhook()
        try:
            yield
        finally:
            self._armed = False
            if armed:
                self._hook()
                self._armed = True

    def pending(self, device: torch.device) -> torch.Tensor | None:
        """The step's values as one device vector [output amax (M), gradient amax (M), input amax (F), weight amax
        (F), small counts (M)] (NaN where a module did not run; F modules planned ``fp8_delayed``), for the
        controller's one read; disarms the hooks. None on an unwatched step. A handful of kernels for all the
        modules together (stack, max), whatever their number. The first :attr:`n_amax` values are amaxes (MAX
        across ranks), the rest counts (SUM)."""
        if not self._armed:
            return None
        self._armed = False
        self._unhook()
        if not self.names:
            return None
        nan = torch.full((), math.nan, device=device)

        def stacked(vals: list[torch.Tensor | None]) -> torch.Tensor:
            return torch.stack([nan if v is None else v if v.device == device else v.to(device)
                                for v in vals]).float()

        amax = torch.maximum(stacked(self._hi), stacked(self._lo).neg_())
        return torch.cat([amax, stacked(self._small)])

    @property
    def n_amax(self) -> int:
        return 2 * len(self.names) + 2 * len(self.fp8)

    def clear(self) -> None:
        m = len(self.names)
        none: list[torch.Tensor | None] = [None]
        self._hi, self._lo = none * self.n_amax, none * self.n_amax
        self._small, self._total = none * m, [0] * m

    def remove(self) -> None:
        self._unhook()
        self._armed = False

    # -- the series, the forecasts, the actions (host side) ---------------------------------------------------

    def record(self, step: int, values: list[float], policy: Policy, scale: float | None) -> list[dict[str, Any]]:
        """Add one reading (``values`` from :meth:`pending`, read by the controller) and refresh the forecasts;
        returns the changes due (dicts for the controller to apply: see :meth:`_due`)."""
        m = len(self.names)
        totals = self._total
        self.clear()
        self.readings += 1
        unscale = scale if scale and scale > 0 else 1.0
        fp8_at = {n: f for f, n in enumerate(self.fp8)}
        n_amax, nf = self.n_amax, len(self.fp8)
        for i, name in enumerate(self.names):
            out, grad, small = values[i], values[m + i], values[n_amax + i]
            if math.isnan(out) and math.isnan(grad):
                continue  # the module did not run this step
            s = self.series[name]
            s["step"].append(step)
            s["output"].append(out)
            s["gradient"].append(grad / unscale)
            s["underflow"].append(small / totals[i] if totals[i] else math.nan)
            if name in fp8_at:
                s["fp8_input"].append(values[2 * m + fp8_at[name]])
                s["fp8_weight"].append(values[2 * m + nf + fp8_at[name]])
            fmt = policy.effective_format(name)
            if fmt not in self.ran_in[name]:
                self.ran_in[name].append(fmt)
            self._write(name, step, out, grad / unscale, s["underflow"][-1])
        return self._refresh(step, policy, scale)

    def _write(self, name: str, step: int, out: float, grad: float, under: float) -> None:
        if self.writer is None:
            return
        tag = name or "(root)"
        for key, v in (("output_amax_log2", _log2(out)), ("gradient_amax_log2", _log2(grad)),
                       ("fp16_underflow_share", under)):
            if math.isfinite(v):
                self.writer.add_scalar(f"watch/{tag}/{key}", v, step)

    def _refresh(self, step: int, policy: Policy, scale: float | None) -> list[dict[str, Any]]:
        tasks: list[tuple[str, str, str]] = []
        series: list[tuple[list[float], np.ndarray, float, bool]] = []
        delayed = watch_fp8.delayed_modules(policy) if self.fp8 else set()
        for name in self.names:
            s = self.series[name]
            if len(s["step"]) < 2:
                continue
            # the fit's window only, not the history
            steps = _tail(s["step"], self.window)
            logs = _RecentLogs(s, self.window)  # log2 of a series' window, computed when a target needs it
            for fmt in self.ran_in[name]:
                for kind, limit, vals, rising in self._targets(fmt, logs, scale):
                    tasks.append((name, fmt, kind))
                    series.append((steps, vals, limit, rising))
            if name in delayed:  # the FP8 recipe's saturation (runtime/watch_fp8.py)
                for kind, limit, at, rate in watch_fp8.targets(logs, steps):
                    tasks.append((name, watch_fp8.DELAYED, kind))
                    series.append((at, rate, limit, True))
        due: list[dict[str, Any]] = []
        for (name, fmt, kind), fc in zip(tasks, fit_crossings(series, now=step, horizon=self.horizon)):
            if fc is None:
                continue
            self.forecasts[(name, fmt, kind)] = fc
            if fc.step is not None and fc.step - step <= LOG_HORIZONS * self.horizon:
                self.log.append({"at": step, "module": name, "format": fmt, "kind": kind, **fc.to_dict()})
                if self.writer is not None:
                    self.writer.add_scalar(f"watch/{name or '(root)'}/{fmt}_{kind}_steps_left", fc.step - step, step)
            current = name in delayed if fmt == watch_fp8.DELAYED else fmt == policy.effective_format(name)
            if current and self._acts(fc, step):
                due.append({"module": name, "format": fmt, "kind": kind, "forecast": fc})
        return due

    def _targets(self, fmt: str, logs: dict[str, np.ndarray],
                 scale: float | None) -> list[tuple[str, float, np.ndarray, bool]]:
        """(kind, limit, series, rising) to forecast for a module running in ``fmt`` whose recent readings'
        log2 are ``logs``."""
        top = format_max(fmt)
        if top is None:
            return []
        targets = [("activation", math.log2(top), logs["output"], True)]
        if fmt == "fp16":
            if scale is not None and scale > 0:
                targets.append(("gradient", math.log2(top), logs["gradient"] + math.log2(scale), True))
            if np.isfinite(logs["underflow"]).any():
                # the share's logarithm: a gradient shrinking by a steady factor moves its distribution's tail
                # past 2^-14 at a roughly exponential rate (the share itself bends upwards)
                targets.append(("underflow", math.log2(UNDERFLOW_LIMIT), logs["underflow"], True))
        return targets

    def _acts(self, fc: Crossing, step: int) -> bool:
        """Act on a crossing ahead (from this reading to ``horizon`` steps on) at the confidence asked, on a fit of
        at least :data:`ACT_MIN_POINTS` readings. A line that has crossed already describes either a series beyond
        the limit (a standing condition: the audit's and the reactive fallback's to judge) or readings the line no
        longer follows (a trend that bent back): neither is a forecast."""
        return (fc.step is not None and fc.points >= ACT_MIN_POINTS and step <= fc.step <= step + self.horizon
                and fc.confidence >= self.min_confidence)

    def promotion(self, name: str, fmt: str, kind: str, fc: Crossing, step: int,
                  bf16_ok: bool) -> tuple[str, str] | None:
        """(new format, reason) for a module whose ``kind`` forecast crosses within the horizon, or None."""
        to = _PROMOTE.get(fmt)
        if to == "bf16" and not bf16_ok:
            to = "fp32"
        if to is None:
            return None
        return to, f"promoted from {fmt} to {to} by the watch at step {step}: {describe(name, fmt, kind, fc, step)}"

    def note(self, action: Action) -> None:
        self.actions.append(action)
        log.warning("watch: %s %s at step %d: %s", action.module or "(root)", action.change, action.step,
                    action.reason)

    def to_dict(self) -> dict[str, Any]:
        """The watch's record as JSON-ready data: the options, the series (4 significant digits), the forecasts
        logged (crossings within a few horizons) and the actions."""
        return {
            "every": self.every, "horizon": self.horizon, "min_confidence": self.min_confidence,
            "window": self.window, "readings": self.readings,
            "modules": {n: {"formats": list(self.ran_in[n]),
                            **{k: [_short(v) for v in vals] for k, vals in s.items()}}
                        for n, s in self.series.items() if s["step"]},
            "forecasts": self.log[-2000:],
            "actions": [a.to_dict() for a in self.actions],
        }


def make_watch(on: bool, modules: list[tuple[str, torch.nn.Module]], **options: Any) -> Watch | None:
    """The controller's watch: a :class:`Watch` when ``on`` (its options checked), else None."""
    if not isinstance(on, bool):
        raise OptionError("watch must be True or False", found=repr(on))
    return Watch(modules, **options) if on else None


def describe(name: str, fmt: str, kind: str, fc: Crossing, step: int) -> str:
    """The forecast in words, for a reason and the log."""
    if kind in watch_fp8.KINDS:
        return watch_fp8.describe(kind, fc, step)
    what = {"activation": "its output amax", "gradient": "its scaled output-gradient amax",
            "underflow": "the share of its fp16 output gradient below the normal range"}[kind]
    limit = (f"fp16's underflow limit {UNDERFLOW_LIMIT:g}" if kind == "underflow"
             else f"{fmt}'s largest value {format_max(fmt):g}")
    trend = f"{100 * (2 ** fc.slope - 1):+.2f}% per step"
    assert fc.step is not None
    span = (f", 95% interval {fc.low:.0f}-{fc.high:.0f}" if fc.low is not None and fc.high is not None
            else f", 95% interval from {fc.low:.0f}" if fc.low is not None else "")
    when = (f"{fc.step - step:.0f} steps ahead" if fc.step >= step else
            "crossed on the fitted line since the last readings")
    return (f"{what} moves {trend} (robust fit of {fc.points} readings); forecast to pass {limit} at step "
            f"{fc.step:.0f}{span}, {when} (confidence {fc.confidence:.2f} within the horizon)")


def _first_float(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    if isinstance(out, (tuple, list)):
        for v in out:
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return v
    if isinstance(out, dict):
        for v in out.values():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return v
    return None


class _RecentLogs(dict[str, np.ndarray]):
    """log2 of each series' last ``window`` readings, computed on first use."""

    def __init__(self, series: dict[str, collections.deque[float]], window: int) -> None:
        super().__init__()
        self._series, self._window = series, window

    def __missing__(self, key: str) -> np.ndarray:
        v = self[key] = _log2_array(_tail(self._series[key], self._window))
        return v


def _tail(d: collections.deque[float], n: int) -> list[float]:
    return list(itertools.islice(d, max(0, len(d) - n), None))


def _log2_array(v: list[float]) -> np.ndarray:
    """:func:`_log2` of each value: NaN for 0, negative or NaN, +inf for +inf."""
    a = np.asarray(v, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(a > 0, np.log2(a), np.nan)


def _log2(v: float) -> float:
    return math.log2(v) if v > 0 and math.isfinite(v) else (math.inf if v == math.inf else math.nan)


def _short(v: float) -> float | None:
    return float(f"{v:.4g}") if math.isfinite(v) else None


def apply_due(watch: Watch, due: list[dict[str, Any]], policy: Policy, scaler: torch.amp.GradScaler | None,
              step: int) -> tuple[Policy, tuple[str, ...]]:
    """Carry out the changes :meth:`Watch.record` found due: promotions in a copy of ``policy``, and the loss
    scale's backoff and slower growth on ``scaler`` (recorded in the copy's ``loss_scaling``). Returns (the
    policy, the modules promoted)."""
    cc = policy.target_compute_capability
    bf16_ok = cc is not None and tuple(cc) >= (8, 0)
    promoted: list[str] = []
    replanned: list[str] = []
    scaled = False
    for d in due:
        name, fmt, kind, fc = d["module"], d["format"], d["kind"], d["forecast"]
        if kind in watch_fp8.KINDS:  # the FP8 plan's recipe, before the delayed scale saturates
            if name in replanned:
                continue
            reason = (f"{watch_fp8.DELAYED} -> {watch_fp8.REPLACEMENT} by the watch at step {step}: "
                      f"{describe(name, fmt, kind, fc, step)}")
            policy = watch_fp8.replan(policy, name, reason)
            replanned.append(name)
            watch.note(Action(step, name, "fp8_recipe", f"{watch_fp8.DELAYED} -> {watch_fp8.REPLACEMENT}", reason))
            continue
        if kind == "gradient":
            if scaled or scaler is None or not scaler.is_enabled():
                continue
            scaled = True
            ls = policy.loss_scaling
            old = int(getattr(scaler, "_growth_interval", ls.growth_interval))
            # the growth slows once (x4); later forecasts only back the scale off
            new = old * 4 if not any(a.kind == "loss_scale" for a in watch.actions) else old
            backoff = float(getattr(scaler, "_backoff_factor", ls.backoff_factor))
            scale_t = getattr(scaler, "_scale", None)
            if isinstance(scale_t, torch.Tensor):
                scale_t.mul_(backoff)  # on the device: no sync
            scaler._growth_interval = new  # torch.amp.GradScaler's own field
            reason = describe(name, fmt, kind, fc, step)
            policy = dataclasses.replace(policy, loss_scaling=dataclasses.replace(ls, growth_interval=new))
            change = f"scale x{backoff:g}" + (f", growth interval {old} -> {new}" if new != old else "")
            watch.note(Action(step, name, "loss_scale", change, reason))
            continue
        if name in promoted:
            continue
        promotion = watch.promotion(name, fmt, kind, fc, step, bf16_ok)
        if promotion is None:
            continue
        to, reason = promotion
        policy = policy.with_override(name, to, reason)
        promoted.append(name)
        watch.note(Action(step, name, "promote", f"{fmt} -> {to}", reason))
    return policy, tuple(promoted)
