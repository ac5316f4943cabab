"""audit.json on every sample model equals the stored output of the implementation before the restructuring
(issue 13) and the speed work (issue 14): exact counts equal, real-valued figures within 1e-6 relative.

The stored files are written by ``tests/golden/make_golden.py``; regenerate them only for an intended change
of content, and say so in the commit. They come in variants, one per kind of CPU arithmetic (FP32 kernels sum in
a different order on another instruction set: tests/golden/arithmetic.py); the comparison uses the variant made
on a machine whose arithmetic probe matches this one's. On a machine of an arithmetic no variant was made on,
the original files are compared, and differences are reported as a skip naming the probe, not as a failure:
there, a difference is as likely the CPU's as the code's."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from conftest import ROOT, SAMPLES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "golden"))
from arithmetic import probe, stored_file  # noqa: E402

GOLDEN = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists()) / "tests" / "golden"

# Fields that differ between two runs of the same code: when and where it ran (the machine, its thread count),
# and wall-clock durations. The figures themselves do not depend on the thread count (issue 12's last item).
VOLATILE = {"created", "out"}
VOLATILE_PATHS = {".hardware", ".noise_floor.method", ".noise_floor.threads"}
REL = 1e-6


def _volatile(key: str, path: str = "") -> bool:
    return key in VOLATILE or key.endswith("_wall_s") or f"{path}.{key}" in VOLATILE_PATHS


def differences(a, b, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if _volatile(k, path):
                continue
            if k not in a or k not in b:
                out.append(f"{path}.{k}: only in {'stored' if k in a else 'new'}")
            else:
                out += differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} stored, {len(b)} new"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, bool) or isinstance(b, bool) or isinstance(a, int) and isinstance(b, int):
        return [] if a == b else [f"{path}: {a!r} stored, {b!r} new"]
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if math.isnan(a) and math.isnan(b) or a == b:
            return []
        if math.isfinite(a) and math.isfinite(b) and abs(a - b) <= REL * max(abs(a), abs(b)):
            return []
        return [f"{path}: {a!r} stored, {b!r} new"]
    return [] if a == b else [f"{path}: {str(a)[:80]!r} stored, {str(b)[:80]!r} new"]


def read_as_stored(path: Path) -> dict:
    """A new audit.json with the checkout's path written as the stored files write it (``<ROOT>``)."""
    return json.loads(path.read_text().replace(json.dumps(str(ROOT))[1:-1], "<ROOT>"))


def check_against_stored(name: str, new: dict, adjust=None) -> None:
    """Compare a new audit.json of sample ``name`` with the stored one for this machine's arithmetic (see the
    module docstring); ``adjust(stored, new)`` may align fields the caller changed on purpose."""
    path, known = stored_file(name)
    stored = json.loads(path.read_text())
    _as_this_torch(stored)
    if adjust is not None:
        adjust(stored, new)
    diff = differences(stored, new)
    rel = path.relative_to(GOLDEN.parent.parent)
    if diff and not known:
        pytest.skip(f"{len(diff)} field(s) differ from {rel}, made on a machine of another CPU arithmetic (this "
                    f"one's probe {probe()} has no stored variant: make one with python tests/golden/make_golden.py "
                    f"--variant NAME at an unchanged commit); first: {diff[0]}")
    assert not diff, f"{len(diff)} field(s) differ from {rel}:\n" + "\n".join(diff[:40])


def _as_this_torch(stored: dict) -> None:
    """The stored files were made on torch 2.13. On an older torch one field must differ: the table ops its CUDA
    autocast does not register, which the emulation leaves alone (rms_norm before 2.13; an empty list on 2.13,
    which tests/emulation/test_emulation.py checks)."""
    from precision_audit.emulation.autocast_policy import check_registrations

    emulation = stored.get("emulation")
    if isinstance(emulation, dict) and "table_ops_not_registered" in emulation:
        emulation["table_ops_not_registered"] = list(check_registrations()[1])


@pytest.mark.parametrize("name", SAMPLES)
def test_audit_json_equals_the_stored_one(sample_audits, name):
    _, out, _ = sample_audits.get(name)
    check_against_stored(name, read_as_stored(out / "audit.json"))


def test_the_comparison_catches_a_changed_count_and_a_drifted_error():
    a = {"layers": [{"n": 3, "err": 0.5, "created": "x"}]}
    assert differences(a, {"layers": [{"n": 3, "err": 0.5 * (1 + 1e-7), "created": "y"}]}) == []
    assert differences(a, {"layers": [{"n": 4, "err": 0.5, "created": "x"}]})
    assert differences(a, {"layers": [{"n": 3, "err": 0.5 * (1 + 1e-5), "created": "x"}]})
    assert differences(a, {"layers": [{"n": 3, "created": "x"}]})
