"""One format vocabulary (issue 13 item 4): the orders and limits live in precision_audit/formats.py and every
other module takes them from there; the limits agree with the formats' bit layouts; importing the vocabulary
imports no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from precision_audit import formats, gpus
from precision_audit.analysis import performance
from precision_audit.formats import SPECS, Format, names
from precision_audit.planning import rules
from precision_audit.policy import schema
from precision_audit.report import html
from precision_audit.runtime import apply

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())  # the repository

# (format, exponent bits, mantissa bits, has inf): IEEE-like layouts; e4m3fn has no inf and one NaN pattern,
# which takes the all-ones mantissa at the top exponent (OCP FP8 spec), so its max has mantissa 110b.
LAYOUTS = [(Format.FP16, 5, 10, True), (Format.BF16, 8, 7, True), (Format.FP8_E5M2, 5, 2, True),
           (Format.FP8_E4M3, 4, 3, False), (Format.FP32, 8, 23, True)]


def _layout_limits(exponent_bits: int, mantissa_bits: int, has_inf: bool) -> tuple[float, float, float]:
    """(max, min normal, min subnormal) from the bit layout alone."""
    bias = 2 ** (exponent_bits - 1) - 1
    if has_inf:  # the top exponent is inf/NaN
        top, top_mantissa = 2 ** exponent_bits - 2 - bias, 2 - 2.0**-mantissa_bits
    else:  # e4m3fn: the top exponent holds numbers, all-ones mantissa is NaN
        top, top_mantissa = 2 ** exponent_bits - 1 - bias, 2 - 2.0 ** -(mantissa_bits - 1)
    return top_mantissa * 2.0**top, 2.0 ** (1 - bias), 2.0 ** (1 - bias - mantissa_bits)


@pytest.mark.parametrize("fmt, e, m, inf", LAYOUTS, ids=lambda v: v.value if isinstance(v, Format) else None)
def test_limits_match_the_bit_layout(fmt, e, m, inf):
    s = SPECS[fmt]
    assert (s.max, s.min_normal, s.min_subnormal) == _layout_limits(e, m, inf)
    assert (s.mantissa_bits, s.has_inf) == (m, inf)


def test_fp16_literals_come_from_the_spec():
    s = SPECS[Format.FP16]
    assert (s.max, s.min_normal, s.min_subnormal) == (65504.0, 2.0**-14, 2.0**-24)
    # Brute force: the overflow threshold is where a float32 -> float16 cast first gives inf.
    at = torch.tensor(s.overflow_from, dtype=torch.float32)
    below = torch.nextafter(at, torch.tensor(0.0))
    assert torch.isinf(at.half()) and torch.isfinite(below.half())


def test_every_order_is_taken_from_formats():
    assert schema.POLICY_FORMATS == names(formats.ALL_FORMATS) == tuple(f.value for f in Format)
    assert schema.RUNTIME_FORMATS == names(formats.AUTOCAST_FORMATS) == ("fp32", "tf32", "bf16", "fp16")
    assert performance.ESTIMATED_FORMATS is formats.AUTOCAST_FORMATS
    assert rules.LOW_PRECISION_FORMATS is formats.LOW_PRECISION_FORMATS
    assert html.BAND_FORMATS is formats.RANGE_FORMATS
    assert apply.LOW_PRECISION_DTYPES is formats.LOW_PRECISION_DTYPES
    assert gpus.CANDIDATE_ORDER == names(formats.CANDIDATE_FORMATS)
    # The GPU table's order is written into audit.json (target.supported_formats): fp16 before bf16.
    assert gpus.FORMAT_NAMES == ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")


def test_a_format_and_its_name_are_one_key():
    dtypes = formats.LOW_PRECISION_DTYPES
    assert dtypes["bf16"] is dtypes[Format.BF16] is torch.bfloat16 and dtypes.get("fp16") is torch.float16
    assert {Format.FP16: 1}.get("fp16") == 1 and {"fp16": 1}.get(Format.FP16) == 1
    assert all(isinstance(n, str) and type(n) is str for n in names(formats.ALL_FORMATS)), "plain str for JSON"


def test_names_accepts_names_and_refuses_unknown_ones():
    assert names(["bf16", Format.FP16]) == ("bf16", "fp16")
    with pytest.raises(ValueError):
        names(["fp12"])


def test_the_vocabulary_imports_no_torch():
    code = ("import sys, precision_audit.formats as f, precision_audit.gpus\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert f.SPECS[f.Format.FP16].max == 65504.0 and 'torch' in sys.modules\n"
            "assert f.LOW_PRECISION_DTYPES[f.Format.BF16] is sys.modules['torch'].bfloat16")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_no_format_limit_is_written_as_a_literal():
    limits = {SPECS[f].max for f in Format if f is not Format.FP32} | {SPECS[Format.FP16].min_subnormal,
                                                                        SPECS[Format.FP16].min_normal}
    found = []
    for path in sorted((ROOT / "precision_audit").rglob("*.py")):
        if path.name == "formats.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and type(node.value) in (int, float) and node.value in limits:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not found, "use precision_audit.formats.SPECS: " + "; ".join(found)
