"""TensorBoard scalars and histograms from a finished audit.json, beside the profiler traces in ``--out``/tb/.

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

EVENT_SUFFIX = ".precision-audit"  # our event files end with this; older ones are replaced on rewrite


def write_scalars(audit: Mapping[str, Any], logdir: Path) -> Path:
    """Write the audit's per-layer figures as TensorBoard events into ``logdir``; returns the event file.

    The file is written into a temporary folder first and moved into place, and the event file of an
    earlier audit in the same folder is replaced, so TensorBoard never shows two audits mixed up.
    """
    from .audit_json import as_document

    audit = as_document(audit)
    from torch.utils.tensorboard import SummaryWriter  # tensorboard only when writing

    logdir = Path(logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tb-", dir=logdir))
    try:
        writer = SummaryWriter(log_dir=str(staging), filename_suffix=EVENT_SUFFIX)
        try:
            _write(writer, audit)
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


def _write(w: Any, audit: Mapping[str, Any]) -> None:
    formats = list(audit.get("formats") or [])
    layers = list(audit.get("layers") or [])

    def scalar(tag: str, value: Any, step: int) -> None:
        v = _num(value)
        if v is not None:
            w.add_scalar(tag, v, step)

    for i, L in enumerate(layers):
        for f in formats:
            e = (L.get("error") or {}).get(f) or {}
            for kind in ("local", "accumulated"):
                rec = e.get(kind) or {}
                scalar(f"error/{f}/{kind}_rel_l2", rec.get("rel_l2"), i)
                scalar(f"error/{f}/{kind}_sqnr_db", rec.get("sqnr_db"), i)
        act = L.get("activation") or {}
        grad = (L.get("gradient") or {}).get("output") or {}
        scalar("range/activation_amax", act.get("amax"), i)
        scalar("range/gradient_amax", grad.get("amax"), i)
        for f, bits in (act.get("headroom_bits") or {}).items():
            scalar(f"range/{f}/activation_headroom_bits", bits, i)
        g16 = grad.get("fp16") or {}
        for when in ("unscaled", "at_recommended"):
            scalar(f"range/fp16/gradient_flushed_{when}", (g16.get(when) or {}).get("flushed"), i)
        _histogram(w, "exponents/activation", act.get("exponent_histogram"), i)
        _histogram(w, "exponents/gradient", grad.get("exponent_histogram"), i)

    summary = audit.get("summary") or {}
    scalar("summary/fp32/loss", (summary.get("fp32") or {}).get("loss"), 0)
    for f in formats:
        s = summary.get(f) or {}
        scalar(f"summary/{f}/loss", s.get("loss"), 0)
        scalar(f"summary/{f}/loss_rel_change", s.get("loss_rel_change"), 0)
        scalar(f"summary/{f}/output_rel_l2", (s.get("output") or {}).get("rel_l2"), 0)
        scalar(f"summary/{f}/estimated_step_s", (s.get("step_time") or {}).get("estimated_s"), 0)

    rows = ["| step | module | type | plan |", "|---:|---|---|---|"]
    for i, L in enumerate(layers):
        name = (L.get("name") or "(model)").replace("|", "\\|")
        rows.append(f"| {i} | `{name}` | {L.get('type', '')} | {(L.get('plan') or {}).get('format', '')} |")
    w.add_text("layers", "\n".join(rows), 0)


def _histogram(w: Any, tag: str, hist: Any, step: int) -> None:
    """A histogram over binary exponents: bucket e holds the values with 2^e <= |x| < 2^(e+1)."""
    if not isinstance(hist, Mapping) or not hist:
        return
    items = sorted((int(k), int(v)) for k, v in hist.items() if int(v) > 0)
    if not items:
        return
    num = sum(c for _, c in items)
    total = sum(e * c for e, c in items)
    sq = sum(e * e * c for e, c in items)
    w.add_histogram_raw(tag, min=float(items[0][0]), max=float(items[-1][0] + 1), num=num, sum=float(total),
                        sum_squares=float(sq), bucket_limits=[float(e + 1) for e, _ in items],
                        bucket_counts=[c for _, c in items], global_step=step)
