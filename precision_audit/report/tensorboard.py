"""TensorBoard events from a finished audit's record (precision_audit/record/__init__.py), beside the profiler traces in
``--out``/tb/ (docs/report.md, "TensorBoard").

TensorBoard's step axis is the training step the audit looked at (``step``: 0 for an audit on its own; a callback
that audits again every K steps passes the trainer's step), so repeated audits of one run line up as curves.
Per-module figures, which have no step of their own, go through the plugins made for them instead of borrowing
the step axis as a layer index:

- scalars ``summary/<format>/{loss,loss_rel_change,output_rel_l2,estimated_step_s}`` and ``summary/fp32/loss``:
  the whole model, as the report's Formats table;
- scalars ``layers/<format>/{worst_local_rel_l2,worst_accumulated_rel_l2}``, ``layers/fp16/min_headroom_bits``
  and ``loss_scale/recommended_init_scale``: the worst module's figure (its name is in the text table);
- histograms ``error/<format>/{local,accumulated}_log10_rel_l2``: how the modules' errors are spread, one value
  per module (log10 of its relative L2 error; exact modules left out), and ``exponents/{activation,gradient}``:
  the binary exponents of every value of the leaf modules' outputs and output gradients;
- text ``layers``: one markdown table row per module (format, errors, amax, headroom, flushed share, plan);
- a custom-scalars layout (the CUSTOM SCALARS tab) grouping the summary curves per format.

Non-finite values (null in audit.json) are left out rather than written as NaN.

Example::

    write_scalars(json.load(open("audit/audit.json")), Path("audit/tb"), step=0)
    # tensorboard --logdir audit/tb
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..record import AuditRecord
from ..record.codec import as_record
from .event_file import (
    custom_scalars_value,
    file_version_event,
    histogram_value,
    scalar_value,
    summary_event,
    text_value,
    tf_record,
)
from .numbers import fmt_num

EVENT_SUFFIX = ".precision-audit"  # our event files end with this; older ones are replaced on rewrite


def write_scalars(audit: AuditRecord | Mapping[str, Any], logdir: Path, step: int = 0) -> Path:
    """Write the audit's figures as TensorBoard events into ``logdir`` at training step ``step``; returns the
    event file.

    ``audit`` is the audit's record, or audit.json's content (read into the record first). The file is written
    into a temporary folder first and moved into place, and the event file of an
    earlier audit in the same folder is replaced, so TensorBoard never shows two audits mixed up. The events are
    encoded here (precision_audit/report/event_file.py): neither ``torch.utils.tensorboard`` nor the
    ``tensorboard`` package is imported.
    """
    logdir = Path(logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    data = b"".join(tf_record(e) for e in _events(as_record(audit), step))
    # the name SummaryWriter gives its files (tensorboard's EventFileWriter): TensorBoard reads every
    # events.out.tfevents.* file of a folder, in the order of their names
    name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILE_IDS)}"
            f"{EVENT_SUFFIX}")
    staging = Path(tempfile.mkdtemp(prefix=".tb-", dir=logdir))
    try:
        new = staging / name
        new.write_bytes(data)
        for old in logdir.glob(f"events.out.tfevents.*{EVENT_SUFFIX}"):
            old.unlink()
        target = logdir / name
        os.replace(new, target)
        return target
    finally:
        shutil.rmtree(staging, ignore_errors=True)


_FILE_IDS = itertools.count()  # the last part of an event file's name: files of one process differ
_WRITER = "precision_audit.report.tensorboard"  # the event file's source_metadata.writer


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def _events(r: AuditRecord, step: int) -> list[bytes]:
    """The event file's events, encoded: its version, one event holding every scalar and histogram of ``step``, the
    text table at ``step``, the custom-scalars layout (at step 0, as SummaryWriter writes it)."""
    values: list[bytes] = []  # one event holding every value of this step

    def scalar(tag: str, value: Any) -> None:
        v = _num(value)
        if v is not None and math.isfinite(v):
            values.append(scalar_value(tag, v))

    scalar("summary/fp32/loss", r.summary.fp32.loss)
    for f in r.formats:
        s = r.summary.formats.get(f)
        if s is not None:
            scalar(f"summary/{f}/loss", s.loss)
            scalar(f"summary/{f}/loss_rel_change", s.loss_rel_change)
            scalar(f"summary/{f}/output_rel_l2", s.output.rel_l2 if s.output else None)
            scalar(f"summary/{f}/estimated_step_s", s.step_time.estimated_s)
    if r.loss_scale is not None:
        scalar("loss_scale/recommended_init_scale", r.loss_scale.recommended_init_scale)
    for f in r.formats:
        for kind in ("local", "accumulated"):
            errs = [_num(m.rel_l2) for L in r.layers if (e := L.error.get(f)) is not None
                    and (m := getattr(e, kind)) is not None]
            finite = [v for v in errs if v is not None and math.isfinite(v)]
            scalar(f"layers/{f}/worst_{kind}_rel_l2", max(finite, default=None))
            values.extend(_histogram(f"error/{f}/{kind}_log10_rel_l2", _log10_counts(finite)))
    rooms = [_num(L.activation.headroom_bits.get("fp16")) for L in r.layers]
    scalar("layers/fp16/min_headroom_bits", min((v for v in rooms if v is not None and math.isfinite(v)),
                                                default=None))
    leaves = [L for L in r.layers if L.is_leaf] or list(r.layers)
    for tag, hists in (("exponents/activation", [L.activation.exponent_histogram for L in leaves]),
                       ("exponents/gradient", [L.gradient.output.exponent_histogram for L in leaves])):
        counts: dict[int, int] = {}
        for h in hists:
            for k, c in (h or {}).items():
                counts[int(k)] = counts.get(int(k), 0) + int(c)
        values.extend(_histogram(tag, counts))
    layout = {"precision-audit": {
        "loss change (relative to FP32)": ("Multiline", [r"summary/.*/loss_rel_change"]),
        "output error (relative L2)": ("Multiline", [r"summary/.*/output_rel_l2"]),
        "worst module's local error": ("Multiline", [r"layers/.*/worst_local_rel_l2"]),
        "estimated step time (s)": ("Multiline", [r"summary/.*/estimated_step_s"])}}
    return [file_version_event(time.time(), _WRITER),
            summary_event(time.time(), step, values),
            summary_event(time.time(), step, [text_value("layers", _layer_table(r))]),
            summary_event(time.time(), 0, [custom_scalars_value(layout)])]


def _log10_counts(errors: list[float]) -> dict[int, int]:
    """Modules per decade of relative error (bucket d: 10^d <= error < 10^(d+1)); exact ones (0) left out."""
    out: dict[int, int] = {}
    for v in errors:
        if v > 0:
            d = math.floor(math.log10(v))
            out[d] = out.get(d, 0) + 1
    return out


def _layer_table(r: AuditRecord) -> str:
    """The per-module figures as one markdown table (TensorBoard's TEXT tab renders it)."""
    head = ["#", "module", "type", "plan"]
    for f in r.formats:
        head += [f"{f} local", f"{f} accum."]
    head += ["act. amax", "fp16 headroom (bits)", "grad flushed fp16 (scale 1)"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, L in enumerate(r.layers):
        cells = [str(i), "`" + (L.name or "(model)").replace("|", "\\|") + "`", L.type, str(L.plan.format)]
        for f in r.formats:
            e = L.error.get(f)
            for kind in ("local", "accumulated"):
                m = getattr(e, kind) if e is not None else None
                cells.append("—" if m is None else fmt_num(m.rel_l2))
        un = L.gradient.output.fp16.unscaled or {}
        cells += [fmt_num(L.activation.amax), fmt_num(L.activation.headroom_bits.get("fp16")),
                  fmt_num(un.get("flushed"))]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _histogram(tag: str, hist: Any) -> list[bytes]:
    """A histogram over binary exponents (bucket e holds the values with 2^e <= |x| < 2^(e+1)): its summary
    value, none for an empty one."""
    if not isinstance(hist, Mapping) or not hist:
        return []
    items = sorted((int(k), int(v)) for k, v in hist.items() if int(v) > 0)
    if not items:
        return []
    num = sum(c for _, c in items)
    total = sum(e * c for e, c in items)
    sq = sum(e * e * c for e, c in items)
    return [histogram_value(tag, min=float(items[0][0]), max=float(items[-1][0] + 1), num=num, sum=float(total),
                            sum_squares=float(sq), bucket_limits=[float(e + 1) for e, _ in items],
                            bucket_counts=[c for _, c in items])]
