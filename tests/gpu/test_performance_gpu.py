"""Measured per-layer times, padded-vs-misaligned GEMM timings, and predicted vs measured speedup.

On a GPU (``gpu`` marker) on GPT sizes that fill it, with the speed checks; on the fake device
(tests/fakecuda.py) on small sizes, checking that every figure is produced and where it says it was
measured (not its value: CPU time says nothing about a GPU).
Run the real ones with: python -m pytest -m gpu tests/gpu -q -s   (-s prints the figures)
"""

from __future__ import annotations

import textwrap

import torch

from conftest import ROOT, layer
from fakecuda import gpu  # noqa: F401 - the fixture
from precision_audit.audit import AuditOptions, run_audit


def _gpt(tmp_path, n_layer, d_model, vocab, batch, seq):
    f = tmp_path / f"gpt_{n_layer}_{d_model}.py"
    f.write_text(textwrap.dedent(f"""
        import importlib.util, torch
        spec = importlib.util.spec_from_file_location("tiny_gpt_base",
                                                      {str(ROOT / 'sample_models/tiny_gpt/model.py')!r})
        base = importlib.util.module_from_spec(spec); spec.loader.exec_module(base)
        def build_model():
            return base.build_model(n_layer={n_layer}, d_model={d_model}, vocab_size={vocab}, block_size={seq},
                                    n_head=max(1, {d_model} // 64))
        loss_fn = base.loss_fn
        def sample_batch():
            g = torch.Generator().manual_seed(0)
            idx = torch.randint(0, {vocab}, ({batch}, {seq}), generator=g)
            return idx, torch.roll(idx, -1, 1)
    """))
    return f


def test_measured_layer_times_and_padded_gemm_timing(tmp_path, gpu):
    size = (2, 256, 50257, 8, 128) if gpu.real else (1, 64, 1001, 2, 16)  # a misaligned vocabulary either way
    a = run_audit(AuditOptions(model=str(_gpt(tmp_path, *size)), out=tmp_path / "o", target="h100",
                               steps=3 if gpu.real else 1)).audit
    assert a["mode"] == "cuda"
    head = layer(a, "lm_head")
    assert head["cost"]["measured_forward_time_s"]["bf16"] > 0
    measured = [f["measured"] for f in head["alignment"] if f.get("measured")]
    assert measured, "the misaligned LM head GEMM is timed as is and padded"
    m = measured[0]
    print("lm_head bf16 GEMM as is:", m["as_is"], "padded:", m["padded"])
    assert m["as_is"]["measured_s"] > 0 and m["padded"]["measured_s"] > 0
    assert m["padded"]["timed_as"]["n"] % 8 == 0 and m["as_is"]["timed_as"]["n"] == size[2]
    assert m["measured_on"] == torch.cuda.get_device_name()
    assert torch.cuda.get_device_name() in m["as_is"]["judged_against"]  # the measured GPU, not the target
    peaks = {k: v["peak_gpu_bytes"] for k, v in a["memory"]["per_format"].items()}
    print("peak GPU bytes per step above its baseline:", peaks)
    assert all(isinstance(v, int) and v >= 0 for v in peaks.values()), peaks


def test_predicted_vs_measured_bf16_speedup_on_a_gpt_that_fills_the_gpu(tmp_path, gpu):
    """Issue 31: within 20% of the measured speed-up, the GPU it runs on as the target (the H200 run of
    2026-11-27 read 7.79x predicted for an H100 target against 5.36x measured; the calibration of
    analysis/cost.py gives 6.17x for an H200 target: docs/gpu.md, "The cost model's calibration")."""
    size = (12, 1024, 50304, 16, 512) if gpu.real else (1, 64, 1024, 2, 16)
    a = run_audit(AuditOptions(model=str(_gpt(tmp_path, *size)), out=tmp_path / "o",
                               target=None if gpu.real else "h100", steps=3 if gpu.real else 1, formats=None)).audit
    measured = a["summary"]["fp32"]["step_time"]["measured_s"] / a["summary"]["bf16"]["step_time"]["measured_s"]
    predicted = a["estimates"]["speedup_vs_fp32"]["bf16"]
    print(f"BF16 over FP32: predicted {predicted:.2f}x, measured {measured:.2f}x on {torch.cuda.get_device_name()}")
    assert a["summary"]["bf16"]["step_time"]["measured_on"] == f"{torch.cuda.get_device_name()} (cuda)"
    if gpu.real:
        assert measured > 1.5, "BF16 should be clearly faster than strict FP32 on a GPU this size"
        assert a["target"]["reason"].startswith("detected"), a["target"]
        assert abs(predicted / measured - 1) <= 0.2, "the calibrated cost model should be within 20% of the GPU"
