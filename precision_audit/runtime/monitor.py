"""The stability monitor: what happened at each training step, as data, and logged.

Per step: the loss, the loss scale used, whether the step was skipped (a non-finite gradient: found by the
GradScaler, or by the controller's own check when loss scaling is off), the total gradient norm (unscaled), the
modules whose own parameter gradients were non-finite, the module where the non-finite values started and what
was seen there, whether the loss spiked against the running median, and any module promoted to fp32.

Example::

    monitor = controller.monitor
    monitor.history[-1].skipped        # a StepRecord per step (the last ``history_limit`` of them)
    monitor.summary()["skipped_steps"] # counts over the whole run
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import OptionError

log = logging.getLogger(__name__)

#: A loss spike's scale is at least this many robust standard deviations of the window (see StabilityMonitor).
SPREAD_FACTOR = 3.0


@dataclass(frozen=True)
class StepRecord:
    """One training step as the controller saw it."""

    step: int  # 1-based
    loss: float  # the unscaled loss (nan / inf when non-finite)
    scale: float | None  # the loss scale used for this step; None when loss scaling is disabled
    skipped: bool  # the optimizer update was skipped because a gradient was non-finite (in every format)
    grad_norm: float  # total 2-norm of the unscaled gradients (nan / inf when non-finite)
    nonfinite_modules: tuple[str, ...] = ()  # modules whose own parameter gradients had inf/NaN
    sources: tuple[str, ...] = ()  # where the non-finite values started (the forward source first)
    loss_spike: bool = False  # loss > spike_factor x the running median of the previous losses
    promoted: tuple[str, ...] = ()  # modules the adaptive controller moved to fp32 at this step
    source_detail: str = ""  # what was seen at sources[0] when it is a forward source (e.g. "+inf from finite inputs")

    @property
    def loss_finite(self) -> bool:
        return math.isfinite(self.loss)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("nonfinite_modules", "sources", "promoted"):
            d[k] = list(d[k])
        return d


class StabilityMonitor:
    """Records :class:`StepRecord` s, detects loss spikes, keeps run-wide counts, and logs.

    A loss spike is a finite loss more than ``(spike_factor - 1) x s`` above the median of the last
    ``spike_window`` finite losses, checked once at least ``min_history`` losses are in the window, where ``s``
    (the window's scale, :meth:`scale`) is the larger of the median when it is positive and 3 x the window's
    robust spread (1.4826 x the median absolute deviation, the standard deviation for normal noise). For an
    ordinary positive loss, steady against its size, that is the loss above ``spike_factor`` x the median; a loss
    that can be negative (a reward term) or sits near zero is judged against its own noise: its median's size says
    nothing there. ``history`` keeps the last ``history_limit`` records (None: all); ``summary()`` counts over
    every step.
    """

    def __init__(self, *, spike_window: int = 50, spike_factor: float = 3.0, min_history: int = 5,
                 history_limit: int | None = 10_000) -> None:
        if not (isinstance(spike_window, int) and spike_window >= 1):
            raise OptionError("spike_window must be an integer >= 1", found=repr(spike_window))
        if not (isinstance(spike_factor, (int, float)) and spike_factor > 1 and math.isfinite(spike_factor)):
            raise OptionError("spike_factor must be a finite number > 1", found=repr(spike_factor))
        if not (isinstance(min_history, int) and min_history >= 1):
            raise OptionError("min_history must be an integer >= 1", found=repr(min_history))
        self.spike_window = spike_window
        self.spike_factor = spike_factor
        self.min_history = min(min_history, spike_window)
        self.history: collections.deque[StepRecord] = collections.deque(maxlen=history_limit)
        self._window: collections.deque[float] = collections.deque(maxlen=spike_window)
        self.steps = 0
        self.skipped_steps = 0
        self.nonfinite_loss_steps = 0
        self.loss_spikes = 0
        self.nonfinite_counts: collections.Counter[str] = collections.Counter()
        self.source_counts: collections.Counter[str] = collections.Counter()
        self.promotions: list[tuple[int, str]] = []
        self.max_grad_norm_seen = 0.0
        self.last: StepRecord | None = None

    @staticmethod
    def scale(window: list[float], median: float) -> float:
        """The window's scale: max(median if positive, 3 x 1.4826 x median absolute deviation); ``|median|`` for a
        window with no spread and no positive median (all equal), so that a flat series still has a size."""
        spread = 1.4826 * statistics.median(abs(v - median) for v in window)
        s = max(median if median > 0 else 0.0, SPREAD_FACTOR * spread)
        return s if s > 0 else abs(median)

    def is_spike(self, loss: float) -> tuple[bool, float | None]:
        """(whether ``loss`` spikes against the current window, the window's median or None)."""
        if not math.isfinite(loss) or len(self._window) < self.min_history:
            return False, None
        window = list(self._window)
        med = statistics.median(window)
        return loss - med > (self.spike_factor - 1.0) * self.scale(window, med), med

    def observe(self, *, step: int, loss: float, scale: float | None, skipped: bool, grad_norm: float,
                nonfinite_modules: tuple[str, ...] = (), sources: tuple[str, ...] = (),
                promoted: tuple[str, ...] = (), source_detail: str = "") -> StepRecord:
        """Record one step; returns its :class:`StepRecord` (with ``loss_spike`` decided here)."""
        spike, med = self.is_spike(loss)
        rec = StepRecord(step=step, loss=loss, scale=scale, skipped=skipped, grad_norm=grad_norm,
                         nonfinite_modules=tuple(nonfinite_modules), sources=tuple(sources), loss_spike=spike,
                         promoted=tuple(promoted), source_detail=source_detail)
        self.history.append(rec)
        self.last = rec
        self.steps += 1
        if math.isfinite(loss):
            self._window.append(loss)
        else:
            self.nonfinite_loss_steps += 1
        if math.isfinite(grad_norm):
            self.max_grad_norm_seen = max(self.max_grad_norm_seen, grad_norm)
        self.skipped_steps += skipped
        self.loss_spikes += spike
        self.nonfinite_counts.update(nonfinite_modules)
        self.source_counts.update(sources)
        self.promotions.extend((step, name) for name in promoted)
        if nonfinite_modules and not skipped:  # a skipped step is logged by the controller, with its source
            where = f" in {', '.join(nonfinite_modules[:6])}{' ...' if len(nonfinite_modules) > 6 else ''}" \
                if nonfinite_modules else ""
            log.info("step %d: non-finite gradients%s%s%s", step, where,
                     f" (from {', '.join(sources)})" if sources else "",
                     f"; step skipped at loss scale {scale:g}" if skipped and scale is not None else "")
        if spike:
            log.warning("step %d: loss spike %.6g, more than %g x the window's scale above its running median %.6g "
                        "(last %d steps)", step, loss, self.spike_factor - 1.0, med, len(self._window) - 1)
        return rec

    def summary(self) -> dict[str, Any]:
        """Run-wide counts as a JSON-ready dict (floats may be nan/inf where the values were)."""
        last = self.last
        return {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "skip_rate": self.skipped_steps / self.steps if self.steps else 0.0,
            "nonfinite_loss_steps": self.nonfinite_loss_steps,
            "loss_spikes": self.loss_spikes,
            "nonfinite_modules": dict(self.nonfinite_counts.most_common()),
            "sources": dict(self.source_counts.most_common()),
            "promotions": [{"step": s, "module": n} for s, n in self.promotions],
            "last_loss": last.loss if last else None,
            "last_scale": last.scale if last else None,
            "last_grad_norm": last.grad_norm if last else None,
            "max_grad_norm": self.max_grad_norm_seen,
            "running_median_loss": statistics.median(self._window) if self._window else None,
        }
