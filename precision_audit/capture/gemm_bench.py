"""On a GPU: time single GEMMs in isolation with CUDA events (achieved TFLOP/s; misaligned vs padded).

Tensor Core use is judged from speed and dtype, not from kernel names: a GEMM that runs faster than the
GPU's FP32 non-Tensor-Core peak must be on Tensor Cores.
"""

from __future__ import annotations

import torch

from .ops import GemmOp


def time_gemm(m: int, n: int, k: int, batch: int, dtype: torch.dtype, device: str, repeats: int = 20) -> float:
    """Median seconds of one ``[batch, m, k] @ [batch, k, n]`` on ``device`` (CUDA only)."""
    if not device.startswith("cuda"):
        raise ValueError("time_gemm needs a CUDA device")
    a = torch.randn(batch, m, k, device=device, dtype=dtype)
    b = torch.randn(batch, k, n, device=device, dtype=dtype)
    for _ in range(3):
        torch.bmm(a, b)
    times = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.bmm(a, b)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    return times[len(times) // 2]


def measure(g: GemmOp, dtype: torch.dtype, device: str, fp32_peak_tflops: float | None) -> dict:
    """Achieved TFLOP/s of ``g`` as a plain GEMM of its (M, N, K, batch), and what that says about Tensor Cores."""
    t = time_gemm(g.m, g.n, g.k, g.batch, dtype, device)
    achieved = 2 * g.batch * g.m * g.n * g.k / t / 1e12
    verdict = None
    if fp32_peak_tflops:
        verdict = ("Tensor Cores in use: faster than the FP32 non-Tensor-Core peak" if achieved > fp32_peak_tflops
                   else "no evidence of Tensor Cores: not faster than the FP32 non-Tensor-Core peak "
                        "(small or latency-bound GEMMs look like this too)")
    return {"measured_s": t, "achieved_tflops": achieved, "tensor_cores": verdict}
