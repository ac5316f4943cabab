"""On a GPU: cuda mode (real autocast, real kernels) and emulated mode agree on the sample models.

Skipped without CUDA. Run with: python -m pytest -m gpu tests/gpu -q
"""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT, SAMPLES
from precision_audit.audit import AuditOptions, run_audit

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _audit(name, tmp_path, **kw):
    d = ROOT / "sample_models" / name
    return run_audit(AuditOptions(model=str(d / "model.py"), batch=str(d / "sample.pt"), out=tmp_path / kw.get("device", "emu"),
                                  target="h100", steps=3, **kw)).audit


@pytest.mark.parametrize("name", SAMPLES)
def test_cuda_mode_and_emulation_agree(name, tmp_path):
    real = _audit(name, tmp_path, device="cuda")
    emu = _audit(name, tmp_path, emulate=True)
    assert real["mode"] == "cuda" and emu["mode"] == "emulated"
    for fmt in ("fp16", "bf16"):
        over_real = {L["name"] for L in real["layers"] if L["error"][fmt]["nonfinite_outputs"]}
        over_emu = {L["name"] for L in emu["layers"] if L["error"][fmt]["nonfinite_outputs"]}
        assert over_real == over_emu, f"{fmt}: overflowing modules differ: cuda {over_real} vs emulated {over_emu}"
        ratios = []
        for Lr, Le in zip(real["layers"], emu["layers"]):
            assert Lr["name"] == Le["name"]
            a, b = Lr["error"][fmt]["accumulated"]["rel_l2"], Le["error"][fmt]["accumulated"]["rel_l2"]
            if a and b and a > 1e-6 and b > 1e-6:
                ratios.append((Lr["name"], a / b))
                assert 0.5 <= a / b <= 2.0, f"{fmt} {Lr['name']}: cuda rel_l2 {a:.3g} vs emulated {b:.3g}"
        print(name, fmt, "per-layer cuda/emulated rel_l2 ratios:", [f"{n}:{r:.2f}" for n, r in ratios])
        assert real["summary"][fmt]["step_time"]["measured_s"] is not None
