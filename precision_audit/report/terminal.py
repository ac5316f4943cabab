"""The terminal side of an audit: progress while it runs (stderr) and the summary table at the end (stdout).

:class:`Progress` is the ``progress`` callback :func:`precision_audit.audit.run_audit` takes: call it with a
stage message and it starts that stage. On a terminal each stage gets its own tqdm bar with a running clock
(finished stages stay on screen with their time); when stderr is not a terminal (CI logs, pipes) each stage
is one plain line, ``[3] fp16 pass``; with ``quiet=True`` nothing is printed. :meth:`Progress.bar` gives a
nested bar for work inside a stage (layers of one format's pass, say), and does nothing off a terminal.

Example::

    with Progress(quiet=args.quiet) as progress:
        result = run_audit(opts, progress)
    print(summary_text(result.audit))
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TextIO

from tqdm import tqdm

from ..record import AlignmentRanking, AuditRecord, LossScale, PlanReport, StepTime
from .grouped import fp8_moves, why_chosen
from .numbers import fmt_num, fmt_scale, fmt_seconds

#: When the audit records profiler traces, and what shows them (docs/report.md, "TensorBoard"): said once here for
#: the terminal and the report, so a new way to ask for traces is a change of this line.
TRACES_WHEN = "--trace records them, with --steps 1 or more (1 by default on a GPU, 0 in emulated mode)"
PROFILER_TAB = "TensorBoard's PyTorch Profiler tab needs pip install \"precision-audit[tensorboard]\""

STAGE_FORMAT = "{desc} {elapsed}"
BAR_FORMAT = "  {desc}: {percentage:3.0f}%|{bar:24}| {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}]"


class _NoBar:
    """What :meth:`Progress.bar` hands out when no bar is drawn: accepts the calls a tqdm bar does."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "") -> None:
        pass


class Progress:
    """Progress of one audit on ``stream`` (default stderr); callable with a stage message.

    ``tty`` defaults to ``stream.isatty()``. Use as a context manager (or call :meth:`close`) so the last
    stage is finished and the clock thread stops.
    """

    def __init__(self, quiet: bool = False, stream: TextIO | None = None, tty: bool | None = None,
                 refresh_s: float = 0.25) -> None:
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty()) if tty is None else tty
        self.stages: list[str] = []
        self._bar: tqdm | None = None
        self._started = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._refresh_s = refresh_s
        self._ncols: int | None
        self._nrows: int | None
        self._ncols, self._nrows = _size(self.stream) if self.tty else (None, None)
        encoding = (getattr(self.stream, "encoding", None) or "").lower().replace("-", "")
        self._done = "✓" if encoding in ("utf8", "") else "done"
        self._ellipsis = "…" if self._done == "✓" else "..."

    # The callback run_audit calls.
    def __call__(self, message: str) -> None:
        self.stages.append(message)
        n = len(self.stages)
        if self.quiet:
            return
        if not self.tty:
            print(f"[{n}] {message}", file=self.stream, flush=True)
            return
        desc = f"[{n}] {message}"
        room = (self._ncols or 100) - 12  # the clock and the done mark
        if len(desc) > room:
            desc = desc[: room - len(self._ellipsis)] + self._ellipsis
        with self._lock:
            self._finish_stage()
            self._bar = tqdm(total=1, desc=desc, bar_format=STAGE_FORMAT, file=self.stream,
                             leave=True, ncols=self._ncols, nrows=self._nrows, mininterval=0)
            self._started = time.perf_counter()
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="precision-audit-progress", daemon=True)
            self._ticker.start()

    @contextmanager
    def bar(self, desc: str, total: int, unit: str = "layers") -> Iterator[Any]:
        """A nested bar for ``total`` steps of work inside the current stage; ``update(n)`` advances it."""
        if self.quiet or not self.tty or total <= 0:
            yield _NoBar()
            return
        b = tqdm(total=total, desc=desc, unit=unit, bar_format=BAR_FORMAT, file=self.stream, leave=False,
                 ncols=self._ncols, nrows=self._nrows)
        try:
            yield b
        finally:
            b.close()

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=2)
            self._ticker = None
        with self._lock:
            self._finish_stage()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _finish_stage(self) -> None:
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_description_str(self._bar.desc + " " + self._done, refresh=False)
            self._bar.close()
            self._bar = None

    def _tick(self) -> None:
        # tqdm redraws only on update(); a stage can run for minutes, so keep its clock moving.
        while not self._stop.wait(self._refresh_s):
            with self._lock:
                if self._bar is not None:
                    self._bar.refresh()


def _size(stream: TextIO) -> tuple[int, int]:
    """The terminal's (columns, lines); (100, 24) where it reports 0 (a pty without a size), since tqdm would
    otherwise draw nothing at all."""
    try:
        cols, lines = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        cols, lines = 0, 0
    return (cols if cols > 0 else 100, lines if lines > 0 else 24)


# --- the summary ------------------------------------------------------------------------------------------


def summary_text(audit: AuditRecord | Mapping[str, Any]) -> str:
    """The table printed at the end of an audit: one line per format, the loss scale, and the plan.

    ``audit`` is the audit's record, or audit.json's content (read into the record first)."""
    from ..record.codec import as_record

    r = as_record(audit)
    summary, target = r.summary, r.target["name"]
    lines = [f"precision-audit: {r.model.class_} ({r.model.parameters:,} parameters), target {target}, {r.mode} mode"]
    has_est = summary.fp32.step_time.estimated_s is not None or any(
        s.step_time.estimated_s is not None for f, s in summary.formats.items() if f in r.formats)
    est_head = f" {'est. step':>10} {'speedup':>8}" if has_est else ""
    lines.append(f"  {'format':<7} {'loss':>12} {'loss change':>12} {'output err':>11} {'non-finite':>10}"
                 f"{est_head}  verdict")

    def est(f: str, step: StepTime) -> str:
        if not has_est:
            return ""
        sp = r.estimated_speedup(f)
        return f" {fmt_seconds(step.estimated_s):>10} {(f'{sp:.2f}x' if sp else '—'):>8}"

    ref = summary.fp32
    lines.append(f"  {'fp32':<7} {fmt_num(ref.loss, 6):>12} {'—':>12} {'—':>11} {'—':>10}{est('fp32', ref.step_time)}"
                 "  reference")
    if ref.nonfinite.note:  # FP32's own non-finite values: said here so that no format seems to be blamed for them
        lines.append(f"  note: {ref.nonfinite.note}")
    over = r.noise_floor.over_budget(r.options.budget) if r.noise_floor is not None else []
    if over:  # every figure below is within FP32's own noise (audit.json's warnings say more)
        lines.append(f"  note: FP32 itself is not reproducible here: a second reduction order changes "
                     f"{' and '.join(over)}; the figures below cannot tell low precision from summation order "
                     "(see the warnings)")
    for f in r.formats:
        s = summary.formats[f]
        out = s.output.rel_l2 if s.output else None
        # a pass that raised has no figures (n/a, its verdict says why), not non-finite ones (inf/NaN)
        na = s.pass_error is not None
        loss, change = ("n/a", "n/a") if na else (fmt_num(s.loss, 6), fmt_num(s.loss_rel_change))
        err, bad = ("n/a", "n/a") if na else (fmt_num(out), str(s.nonfinite.outputs))
        lines.append(f"  {f:<7} {loss:>12} {change:>12} {err:>11} {bad:>10}{est(f, s.step_time)}  {s.verdict}")
    for skipped in r.formats_skipped:
        lines.append(f"  {skipped.format:<7} {skipped.reason}")
    if not has_est and ref.step_time.estimated_note:
        lines.append(f"  step time on {target}: {ref.step_time.estimated_note}")
    lines += _estimate_caveat(r, target) if has_est else []
    lines += _loss_scale_lines(r.loss_scale)
    lines += alignment_lines(r.alignment)
    lines.append(f"  plan: {r.verdict.message}")
    lines += _plan_lines(r.plan)
    lines += [f"    {name} -> {recipe} (FP8 plan, docs/fp8.md): {reason}" for name, recipe, reason in fp8_moves(r)]
    why = why_chosen(r.plan)
    if why:
        lines.append(f"    why {r.plan.default_format}: {why}")
    lines.append(_traces_line(r))
    if r.mode == "emulated":
        lines.append("  numerics emulated on the CPU (no GPU); see the report's warnings")
    return "\n".join(lines)


def _traces_line(r: AuditRecord) -> str:
    """Where the profiler traces are, or how to get them."""
    if r.traces is not None and r.traces.files:
        tb = f"{r.options.out}/tb" if r.options.out else "<out>/tb"
        return f"  profiler traces: tensorboard --logdir {tb} ({PROFILER_TAB})"
    return f"  profiler traces: none in this audit; {TRACES_WHEN}"


def _estimate_caveat(r: AuditRecord, target: str) -> list[str]:
    """The caveat the report gives beside the estimated step times, and the model's kernel floor from
    ``estimates.assumptions`` (analysis/performance.py; docs/report.md, "The cost model's floor")."""
    out = [f"  est. step, speedup: estimates for {target} from the cost model, not measurements "
           "(assumptions in report.html and audit.json's estimates.assumptions)"]
    assumptions = r.estimates.assumptions if r.estimates is not None else []
    out += [f"    {a}" for a in assumptions if isinstance(a, str) and a.startswith("this model: ")]
    return out


def _loss_scale_lines(ls: LossScale | None) -> list[str]:
    if ls is None:
        return []
    def scale(x: Any) -> str:
        return "none" if x is None else fmt_scale(x)

    lines = [f"  fp16 loss scale: {scale(ls.recommended_init_scale)} — {ls.reason}"]
    lp = ls.plan
    if lp and (lp.get("recommended_init_scale"), lp.get("reason")) != (ls.recommended_init_scale, ls.reason):
        lines.append(f"    for the plan: {scale(lp.get('recommended_init_scale'))} — {lp.get('reason')}")
    return lines


def _plan_lines(plan: PlanReport) -> list[str]:
    lines = []
    if plan.chosen:
        ver, est = plan.verification, plan.estimated_step_time_s
        lines.append(f"    returned: {plan.chosen}"
                     + (f", est. {fmt_seconds(est)} per step" if est is not None else "")
                     + (f", verified loss change {fmt_num(ver.loss_rel_change)}"
                        if ver is not None and ver.loss_rel_change is not None else "")
                     + (f", predicted {fmt_num(plan.predicted_loss_rel_change)}"
                        if plan.predicted_loss_rel_change is not None else ""))
    for name, o in plan.overrides.items():
        lines.append(f"    {name or '(model)'} -> {o.format}: {o.reason}")
    return lines


TERMINAL_ALIGNMENT_ROWS = 5  # findings printed; the report lists them all


def alignment_lines(al: AlignmentRanking | None) -> list[str]:
    """The alignment findings, worst first, then the batch-size note once and the collapsed count."""
    if al is None or not (al.findings or al.batch_note):
        return []
    lines = [f"  alignment (ranked by {al.ranked_by or 'estimated time lost per step'}):"]
    found = al.findings or []
    for f in found[:TERMINAL_ALIGNMENT_ROWS]:
        lines.append(f"    {f['rank']}. {f['text']}")
    if len(found) > TERMINAL_ALIGNMENT_ROWS:
        lines.append(f"    ... {len(found) - TERMINAL_ALIGNMENT_ROWS} more in report.html")
    if al.batch_note:
        lines.append(f"    batch size: {al.batch_note['text']}")
    if (al.collapsed or {}).get("text"):
        lines.append(f"    {al.collapsed['text']}")  # type: ignore[index]
    return lines
