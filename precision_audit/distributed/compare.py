"""Compare a distributed audit.json with the single-process one of the same global batch (tests, bench).

Exact for integers and strings; floats within ``rel`` relative (issue 15: "exact counts equal, error metrics
within 1e-6 relative"). Keys describing the run rather than the model's numerics are skipped (VOLATILE) and so
are the per-rank figures a distributed audit reports for one rank's share (PER_RANK; docs/distributed.md).
"""

from __future__ import annotations

import math
from typing import Any

VOLATILE = {"created", "hardware", "options", "distributed", "traces", "tool", "wall_s", "impacts_wall_s",
            "planner_impacts_wall_s"}
#: one rank's share of the batch: shapes, op counts and what is estimated from them (memory, time, alignment)
PER_RANK = {"batch", "estimates", "memory", "alignment", "output_shapes", "estimated_step_time_s", "time",
            "step_time_s", "speedup_vs_fp32", "cost", "flops", "saved_bytes", "est_time_s", "performance",
            "measured_time_s", "step_times_s", "timing", "estimated", "step_time", "output_structure",
            "alignment_note"}


#: figures computed from the loss, a float32 number in both audits whose last bit depends on the order of the
#: batch mean's sum: compared with an absolute tolerance of 1e-6 on the relative change (docs/distributed.md)
LOSS_DERIVED = ("loss_rel_change", "predicted_loss", "measured_loss_rel_change", "first_order")
#: parameter gradients are sums over the batch, added across ranks in another order than one process's GEMM: a
#: value at a rounding threshold may land on its other side (tiny_gpt: 1 element of 429,376 at loss scale 2^17 on
#: an AMD EPYC; 2 of blocks.0.attn.c_attn's 12,480 on an AVX-512 Xeon, whose GEMMs split their sums otherwise):
#: fractions within 5e-4 absolute
PARAMETER_FRACTION_TOLERANCE = 5e-4
PARAMETER_FRACTIONS = ("gradient.parameters", "loss_scale.flushed_fraction", "loss_scale.overflow_fraction")


def _text(s: str) -> str:
    """Per-rank shapes in messages ("[32]" vs "[16]") and figures printed from the loss are not compared (also as
    plain decimals and as "<ratio>x below": noise_floor.rechecks' reasons)."""
    import re

    return re.sub(r"\[[0-9, ]*\]|[0-9.]+e[-+]?[0-9]+|[0-9]+\.[0-9]+|[0-9]+(?=x below)", "#", s)


def differences(a: Any, b: Any, rel: float = 1e-6, path: str = "", skip: frozenset = frozenset()) -> list[str]:
    out: list[str] = []
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k in VOLATILE or k in PER_RANK or k in skip or (k == "factor" and ".calibration" in path):
                # calibration factor = measured loss change / first-order sum, both compared on their own
                continue
            if k not in a or k not in b:
                out.append(f"{path}.{k}: only in {'first' if k in a else 'second'}")
                continue
            out += differences(a[k], b[k], rel, f"{path}.{k}", skip)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        for i, (x, y) in enumerate(zip(a, b)):
            out += differences(x, y, rel, f"{path}[{i}]", skip)
    elif isinstance(a, str) and isinstance(b, str):
        if _text(a) != _text(b):
            out.append(f"{path}: {a!r} vs {b!r}")
    elif isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        if a != b:
            out.append(f"{path}: {a!r} vs {b!r}")
    elif isinstance(a, int) and isinstance(b, int):
        if a != b:
            out.append(f"{path}: {a} vs {b} (count)")
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)):
        fa, fb = float(a), float(b)
        # a figure of noise_floor.rechecks is "<name>.value" (the name says what it is derived from)
        key = path.rsplit(".", 2)[-2] if path.endswith(".value") else path.rsplit(".", 1)[-1]
        loss_derived = any(k in key for k in LOSS_DERIVED)
        if not (fa == fb or (math.isnan(fa) and math.isnan(fb))
                or abs(fa - fb) <= rel * max(abs(fa), abs(fb))
                or (loss_derived and _loss_close(path, fa, fb))
                or (any(p in path for p in PARAMETER_FRACTIONS) and abs(fa - fb) <= PARAMETER_FRACTION_TOLERANCE)):
            out.append(f"{path}: {a!r} vs {b!r} (rel {abs(fa - fb) / max(abs(fa), abs(fb)):.2e})")
    elif a != b:
        out.append(f"{path}: {a!r} vs {b!r}")
    return out


def _loss_close(path: str, a: float, b: float) -> bool:
    if path.endswith("factor"):  # measured / first-order: the measured part carries the loss's rounding
        return abs(a - b) <= 1e-2 * max(abs(a), abs(b))
    if path.endswith("_bound.value"):  # noise_floor.rechecks: up to 10x a measured loss change (the loss margin)
        return abs(a - b) <= 1e-5
    if "predicted_loss_change" in path:
        return abs(a - b) <= 1e-6 * 10  # an absolute loss change, on losses of order 1-10
    return abs(a - b) <= 1e-6
