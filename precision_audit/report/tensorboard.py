"""TensorBoard scalars and histograms from a finished audit's record (precision_audit/record.py), beside the
profiler traces in ``--out``/tb/.

The step of every per-layer series is the layer's position in audit.json's ``layers`` (the order its forward
finished), so a scalar chart reads as "error by depth". Tags:

- ``error/<format>/{local,accumulated}_{rel_l2,sqnr_db}`` — relative L2 error and SQNR (dB) against FP32;
- ``range/activation_amax``, ``range/gradient_amax`` — largest |output| and |∂loss/∂output| (FP32 reference);
- ``range/<format>/activation_headroom_bits`` — log2(format max / activation amax);
- ``range/fp16/gradient_flushed_{unscaled,at_recommended}`` — share of output gradients that flush to zero;
- ``summary/<format>/{loss,loss_rel_change,output_rel_l2}`` — the whole-model figures (step 0);
- histograms ``exponents/activation`` and ``exponents/gradient`` — per layer (step = layer), bucketed by binary
  exponent e (2^e <= |x| < 2^(e+1)), so TensorBoard's histogram view is a ridge plot by depth;
- text ``layers`` — the step -> module name table.

Non-finite values (null in audit.json) are left out rather than written as NaN.

Example::

    write_scalars(json.load(open("audit/audit.json")), Path("audit/tb"))
    # tensorboard --logdir audit/tb
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..record import AuditRecord
from .audit_json import as_record

EVENT_SUFFIX = ".precision-audit"  # our event files end with this; older ones are replaced on rewrite


def write_scalars(audit: AuditRecord | Mapping[str, Any], logdir: Path) -> Path:
    """Write the audit's per-layer figures as TensorBoard events into ``logdir``; returns the event file.

    ``audit`` is the audit's record, or audit.json's content (read into the record first). The file is written
    into a temporary folder first and moved into place, and the event file of an
    earlier audit in the same folder is replaced, so TensorBoard never shows two audits mixed up.
    """
    from torch.utils.tensorboard import SummaryWriter  # tensorboard only when writing

    logdir = Path(logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tb-", dir=logdir))
    try:
        writer = SummaryWriter(log_dir=str(staging), filename_suffix=EVENT_SUFFIX)
        try:
            _write(writer, as_record(audit))
        finally:
            writer.close()
        (new,) = [p for p in staging.iterdir() if p.name.endswith(EVENT_SUFFIX)]
        for old in logdir.glob(f"events.out.tfevents.*{EVENT_SUFFIX}"):
            old.unlink()
        target = logdir / new.name
        os.replace(new, target)
        return target
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def _write(w: Any, r: AuditRecord) -> None:
    from tensorboard.compat.proto.summary_pb2 import Summary  # type: ignore[import-untyped]  # no stubs
    from torch.utils.tensorboard.summary import scalar as scalar_summary

    # One event per step holding all of that step's values (TensorBoard reads each value by its tag), instead
    # of an event, a protobuf and a write per value: ~2,500 values for a 12-layer transformer.
    by_step: dict[int, list[Any]] = {}

    def scalar(tag: str, value: Any, step: int) -> None:
        v = _num(value)
        if v is not None:
            by_step.setdefault(step, []).extend(scalar_summary(tag, v).value)

    for i, L in enumerate(r.layers):
        for f in r.formats:
            e = L.error.get(f)
            for kind in ("local", "accumulated"):
                m = getattr(e, kind) if e is not None else None
                scalar(f"error/{f}/{kind}_rel_l2", m.rel_l2 if m else None, i)
                scalar(f"error/{f}/{kind}_sqnr_db", m.sqnr_db if m else None, i)
        act, grad = L.activation, L.gradient.output
        scalar("range/activation_amax", act.amax, i)
        scalar("range/gradient_amax", grad.amax, i)
        for f, bits in act.headroom_bits.items():
            scalar(f"range/{f}/activation_headroom_bits", bits, i)
        for when in ("unscaled", "at_recommended"):
            scalar(f"range/fp16/gradient_flushed_{when}", (getattr(grad.fp16, when) or {}).get("flushed"), i)
        for tag, hist in (("exponents/activation", act.exponent_histogram),
                          ("exponents/gradient", grad.exponent_histogram)):
            by_step.setdefault(i, []).extend(_histogram(tag, hist))

    scalar("summary/fp32/loss", r.summary.fp32.loss, 0)
    for f in r.formats:
        s = r.summary.formats.get(f)
        if s is None:
            continue
        scalar(f"summary/{f}/loss", s.loss, 0)
        scalar(f"summary/{f}/loss_rel_change", s.loss_rel_change, 0)
        scalar(f"summary/{f}/output_rel_l2", s.output.rel_l2 if s.output else None, 0)
        scalar(f"summary/{f}/estimated_step_s", s.step_time.estimated_s, 0)
    events = w._get_file_writer()
    for step in sorted(by_step):
        events.add_summary(Summary(value=by_step[step]), step)

    rows = ["| step | module | type | plan |", "|---:|---|---|---|"]
    for i, L in enumerate(r.layers):
        name = (L.name or "(model)").replace("|", "\\|")
        rows.append(f"| {i} | `{name}` | {L.type} | {L.plan.format} |")
    w.add_text("layers", "\n".join(rows), 0)


def _histogram(tag: str, hist: Any) -> list[Any]:
    """A histogram over binary exponents (bucket e holds the values with 2^e <= |x| < 2^(e+1)): its summary
    values, none for an empty one."""
    from torch.utils.tensorboard.summary import histogram_raw

    if not isinstance(hist, Mapping) or not hist:
        return []
    items = sorted((int(k), int(v)) for k, v in hist.items() if int(v) > 0)
    if not items:
        return []
    num = sum(c for _, c in items)
    total = sum(e * c for e, c in items)
    sq = sum(e * e * c for e, c in items)
    return list(histogram_raw(tag, min=float(items[0][0]), max=float(items[-1][0] + 1), num=num,
                              sum=float(total), sum_squares=float(sq),
                              bucket_limits=[float(e + 1) for e, _ in items],
                              bucket_counts=[c for _, c in items]).value)
