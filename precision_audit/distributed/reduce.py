"""Reduce the capture records across ranks: the statistics of the global batch from each rank's share.

Every statistic the capture keeps is a sum, a count or a maximum over elements (precision_audit/capture/stats.py),
so a batch split across ranks is put back together with three collectives per pass: element counts and
histogram buckets summed (int64, exact), error sums summed (float64), largest magnitudes maxed. What is *not* a
sum over elements is recomputed from reduced sums, never averaged (docs/distributed.md, "What is reduced"):

- ``rel_l2``, ``sqnr_db`` and ``cosine`` are properties of :class:`ErrorStats` computed from its sums, so they are
  right once the sums are;
- a module's first-order loss impact ``|<dL/dy, y_p - y>|`` is summed over ranks per backward call *before* the
  absolute value (the session logs each call's local impact; :func:`reduce_impacts`);
- the loss is the global batch's from the start: each rank's loss is weighted by its share of the batch and summed
  across ranks in the forward (precision_audit/distributed/session.py), so gradients are those of the global loss;
- parameter gradients are not split along the batch: each rank counts the part it owns (its FSDP shard, or
  rank 0 the whole DDP-reduced gradient; precision_audit/distributed/tensors.py), and those counts are summed.

Structural fields (calls, output shapes, op records, notes) are the same on every rank and are not reduced.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..capture.records import FormatLayerStats, LayerRecord, RunRecord
from ..capture.stats import ErrorStats, MagnitudeHistogram, RangeSummary
from ..formats import Format
from .lockstep import Lockstep

_SPECIAL_COUNTS = ("total", "zeros", "nans", "infs")
_ERROR_COUNTS = ("n", "nonfinite", "ref_nonfinite")
_ERROR_SUMS = ("sum_ref2", "sum_diff2", "sum_dot", "sum_p2")


class Reduction:
    """Collects references to the fields of many records, then reduces them all with three collectives, after a
    check that every rank collected the same fields in the same order (``what``: the pass, for its message)."""

    def __init__(self, lockstep: Lockstep | None = None, what: str = "the statistics") -> None:
        self.lockstep = lockstep if lockstep is not None else Lockstep()
        self.group = self.lockstep.group
        self.what = what
        self._ints: list[tuple[Any, str]] = []
        self._sums: list[tuple[Any, str]] = []
        self._maxes: list[tuple[Any, str]] = []
        self._counts: list[torch.Tensor] = []
        self.layout: list[str] = []  # what was collected, checked equal on every rank before reducing

    # -- collecting -----------------------------------------------------------------------------------------
    def histogram(self, h: MagnitudeHistogram, where: str) -> None:
        self._counts.append(h.counts)
        self._specials(h, where)

    def summary(self, s: RangeSummary, where: str) -> None:
        self._specials(s, where)

    def _specials(self, s: Any, where: str) -> None:
        self._ints += [(s, a) for a in _SPECIAL_COUNTS]
        self._maxes.append((s, "amax"))
        self.layout.append(where)

    def error(self, e: ErrorStats | None, where: str) -> None:
        if e is None:
            self.layout.append(f"{where}:none")
            return
        self._ints += [(e, a) for a in _ERROR_COUNTS]
        self._sums += [(e, a) for a in _ERROR_SUMS]
        self._maxes.append((e, "max_abs"))
        self.layout.append(where)

    def count(self, obj: Any, attr: str, where: str) -> None:
        self._ints.append((obj, attr))
        self.layout.append(f"{where}.{attr}")

    # -- reducing -------------------------------------------------------------------------------------------
    def run(self) -> None:
        _check_same_layout(self.layout, self.lockstep, self.what)
        ints = torch.tensor([int(getattr(o, a)) for o, a in self._ints], dtype=torch.int64)
        flat = torch.cat([ints] + [c.reshape(-1).to(torch.int64) for c in self._counts])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        for i, (o, a) in enumerate(self._ints):
            setattr(o, a, int(flat[i]))
        at = len(self._ints)
        for c in self._counts:
            n = c.numel()
            c.copy_(flat[at:at + n].view_as(c))
            at += n
        sums = torch.tensor([float(getattr(o, a)) for o, a in self._sums], dtype=torch.float64)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.group)
        for (o, a), v in zip(self._sums, sums.tolist()):
            setattr(o, a, v)
        maxes = torch.tensor([float(getattr(o, a)) for o, a in self._maxes], dtype=torch.float64)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=self.group)
        for (o, a), v in zip(self._maxes, maxes.tolist()):
            setattr(o, a, v)


def _check_same_layout(layout: list[str], lockstep: Lockstep, what: str) -> None:
    """Every rank must reduce the same fields in the same order; a rank whose model took another path (a module
    that ran on one rank only, a re-run that failed on one) would otherwise pair unrelated numbers. The refusal
    names the first field that differs (lockstep.py)."""
    crc = zlib.crc32("\n".join(layout).encode(errors="replace"))
    lockstep.check(f"{what} ({len(layout)} fields, crc {crc:08x})", detail=layout)


def reference_fields(red: Reduction, layers: Iterable[LayerRecord]) -> None:
    """What the FP32 reference pass measured in each record (capture/runner.py ``reference_run``)."""
    for rec in layers:
        w = rec.name or "(root)"
        red.histogram(rec.activation, f"{w}.activation")
        red.histogram(rec.grad_output, f"{w}.grad_output")
        red.histogram(rec.grad_param, f"{w}.grad_param")
        red.histogram(rec.grad_loss, f"{w}.grad_loss")
        red.histogram(rec.grad_param_tied, f"{w}.grad_param_tied")
        for slot, h in rec.grad_output_own.items():
            red.histogram(h, f"{w}.grad_output_own[{slot}]")
        for f, fs in rec.formats.items():
            if rec.name != "":  # the root's "local" error is a copy of its accumulated one (format_run)
                red.error(fs.local, f"{w}.{f.value}.local")


def format_fields(red: Reduction, layers: Iterable[LayerRecord], fmt: Format, run: RunRecord) -> None:
    """What one format pass measured (capture/runner.py ``format_run``)."""
    for rec in layers:
        fs = rec.formats.get(fmt)
        if fs is None:
            red.layout.append(f"{rec.name}.{fmt.value}:none")
            continue
        w = f"{rec.name or '(root)'}.{fmt.value}"
        red.error(fs.accumulated, f"{w}.accumulated")
        red.summary(fs.activation, f"{w}.activation")
        red.summary(fs.grad_output, f"{w}.grad_output")
        red.count(fs, "grad_param_nonfinite", w)
    red.count(run, "param_grads_nonfinite", "run")
    red.count(run, "param_grads_nonfinite_shared", "run")
    if run.output is not None and not any(run.output is rec.formats.get(fmt, FormatLayerStats()).accumulated
                                          for rec in layers):
        red.error(run.output, "run.output")


def rebuild_grad_all(layers: Iterable[LayerRecord]) -> MagnitudeHistogram:
    """Every gradient of the FP32 backward, from the reduced records: the session merges each module-output
    gradient into its record and into this total, and each parameter gradient into its owner's ``grad_param``."""
    total = MagnitudeHistogram()
    for rec in layers:
        total.merge(rec.grad_output)
        total.merge(rec.grad_param)
    return total


def reduce_impacts(log: list[tuple[LayerRecord, Format, float]], lockstep: Lockstep | None = None) -> None:
    """Each backward call's ``<dL/dy, y_p - y>`` summed over ranks, then accumulated as the session does for one
    process: the signed sum and the sum of absolute values, in the order of the calls."""
    lockstep = lockstep if lockstep is not None else Lockstep()
    _check_same_layout([f"{rec.name}.{f.value}" for rec, f, _ in log], lockstep, "the loss impacts per call")
    if not log:
        return
    t = torch.tensor([v for _, _, v in log], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=lockstep.group)
    for (rec, f, _), v in zip(log, t.tolist()):
        fs = rec.formats[f]
        fs.loss_impact += v
        fs.loss_impact_abs += abs(v)
        fs.impact_measured = True


def reduced_error_copy(e: ErrorStats, lockstep: Lockstep | None = None) -> ErrorStats:
    """A copy of ``e`` holding the sums over every rank (``e`` itself unchanged)."""
    out = copy.copy(e)
    red = Reduction(lockstep, "an output error's sums")
    red.error(out, "error")
    red.run()
    return out
