"""cuda mode (real autocast, real kernels) and emulated mode agree on the sample models.

On a GPU the comparison is of numerics; on the fake device (tests/fakecuda.py) the cuda-mode audit runs the
emulation's numerics, so the test checks the cuda-mode path end to end and the audit.json fields it reads.
Run the real one with: python -m pytest -m gpu tests/gpu -q
"""

from __future__ import annotations

import contextlib

import pytest

from conftest import ROOT, SAMPLES
from fakecuda import fake_cuda_audit, gpu  # noqa: F401 - the fixture
from precision_audit.audit import AuditOptions, run_audit


def _audit(name, tmp_path, **kw):
    d = ROOT / "sample_models" / name
    return run_audit(AuditOptions(model=str(d / "model.py"), batch=str(d / "sample.pt"),
                                  out=tmp_path / kw.get("device", "emu"), target="h100", **kw)).audit


def overflowing(audit: dict, fmt: str) -> set[str]:
    """Modules whose outputs had non-finite values in the ``fmt`` pass (audit.json: activation.by_format)."""
    return {L["name"] for L in audit["layers"]
            if ((L["activation"].get("by_format") or {}).get(fmt) or {}).get("nonfinite")}


@pytest.mark.parametrize("name", SAMPLES)
def test_cuda_mode_and_emulation_agree(name, tmp_path, gpu):
    if gpu.real:
        real = _audit(name, tmp_path, device="cuda", steps=3)
    else:
        real = fake_cuda_audit(name, target="h100")  # on a fake device of its own, shared with other tests
    with gpu.fake.suspended() if gpu.fake else contextlib.nullcontext():
        emu = _audit(name, tmp_path, emulate=True, steps=0)
    assert real["mode"] == "cuda" and emu["mode"] == "emulated"
    for fmt in ("fp16", "bf16"):
        over_real, over_emu = overflowing(real, fmt), overflowing(emu, fmt)
        assert over_real == over_emu, f"{fmt}: overflowing modules differ: cuda {over_real} vs emulated {over_emu}"
        ratios = []
        for Lr, Le in zip(real["layers"], emu["layers"], strict=True):
            assert Lr["name"] == Le["name"]
            acc_r, acc_e = Lr["error"][fmt]["accumulated"], Le["error"][fmt]["accumulated"]
            a, b = (acc_r or {}).get("rel_l2"), (acc_e or {}).get("rel_l2")
            if a and b and a > 1e-6 and b > 1e-6:
                ratios.append((Lr["name"], a / b))
                assert 0.5 <= a / b <= 2.0, f"{fmt} {Lr['name']}: cuda rel_l2 {a:.3g} vs emulated {b:.3g}"
        print(name, fmt, "per-layer cuda/emulated rel_l2 ratios:", [f"{n}:{r:.2f}" for n, r in ratios])
        assert real["summary"][fmt]["step_time"]["measured_s"] is not None
