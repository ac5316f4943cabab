"""audit.json's ``fp8`` section writes a non-finite figure as null with its ``nonfinite`` count beside it, as the rest
of audit.json does (docs/record.md; issue 32: it held the strings "inf" / "nan", which a reader of numbers trips on).
"""

from __future__ import annotations

import json

import torch

from precision_audit.capture.stats import ErrorStats
from precision_audit.fp8.measure import Fp8Result, result_record
from precision_audit.fp8.other_gemms import OtherGemm, other_gemms_record
from precision_audit.record.codec import to_json


def _overflowed() -> ErrorStats:
    e = ErrorStats()
    e.update(torch.ones(4), torch.tensor([1.0, float("inf"), 1.0, 1.0]))  # one element overflowed
    return e


def test_non_finite_figures_are_null_with_their_count():
    r = Fp8Result(recipes=("fp8_tensorwise",), loss_fp32=1.0, losses={"fp8_tensorwise": None},
                  output_error={"fp8_tensorwise": _overflowed()}, layers=[], history_steps=0,
                  other_gemms=[OtherGemm("", "matmul", 0, (4, 4), (4, 4), recipes={"fp8_tensorwise": _overflowed()})])
    d = to_json(result_record(r, 0.05))
    text = json.dumps(d, allow_nan=False)  # no NaN/Infinity either
    assert '"inf"' not in text and '"nan"' not in text and '"-inf"' not in text
    out = d["output_error"]["fp8_tensorwise"]
    assert out["rel_l2"] is None and out["sqnr_db"] is None and out["cosine"] is None
    assert out["nonfinite"] == 1 and out["elements"] == 4
    other = other_gemms_record(r.other_gemms, 0.05, r.recipes)[0].recipes["fp8_tensorwise"]
    assert other.local is not None
    assert other.local["output"].rel_l2 is None and other.local["output"].nonfinite == 1
    assert other.meets_budget is False
