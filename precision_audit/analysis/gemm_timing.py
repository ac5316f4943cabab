"""Measured GEMM times on the GPU beside the cost model's estimates (cuda mode only).

Each misaligned GEMM of an alignment finding is timed as is and padded to the required multiple, and the largest
distinct GEMMs are timed for their achieved TFLOP/s (the timer: analysis/gemm_bench.py). In emulated mode
nothing is timed: the CPU's time says nothing about the target GPU, and the findings keep their estimates only.
"""

from __future__ import annotations

from ..capture.records import CaptureResult
from ..formats import Format
from ..gpus import GpuSpec
from .performance import Performance


def measure_gemms_on_gpu(capture: CaptureResult, perf: Performance, target: GpuSpec, device: str,
                         formats: tuple[Format, ...]) -> None:
    """Attach measured times to ``perf``: each layer's ``cost.measured_gemms`` and each alignment finding's
    ``measured`` (as is and padded)."""
    from .gemm_bench import measure_gemms  # times kernels: CUDA only

    measure_gemms(capture, perf, target, device, formats)
