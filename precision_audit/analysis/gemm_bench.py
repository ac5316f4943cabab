"""On a GPU: time single GEMMs and convolutions in isolation with CUDA events (achieved TFLOP/s; misaligned
vs padded), and judge Tensor Core use from the speed (docs/gpu.md, "GEMM timings").

Tensor Core use is judged from speed and dtype, not from kernel names: a GEMM that runs faster than the
measured GPU's FP32 non-Tensor-Core peak must be on Tensor Cores. The peak is the GPU the timing ran on (not
the ``--target``, which may be another GPU); when that GPU is not in the table, no verdict is given.

- a matmul-like op is timed as a batched matmul of its (M, N, K, batch), padded on M, N and K;
- a convolution is timed as the convolution itself (its input, weight, stride, padding, dilation, groups),
  padded on the input and output channels: what a person pads (K = C_in x kernel area is not a free size);
- an attention op is timed as its QK^T GEMM.

Each distinct shape and dtype is timed once per audit (a :class:`GemmTimer` caches the times).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import flop_counter

from ..capture.ops import ConvSpec, GemmOp
from ..formats import LOW_PRECISION_DTYPES, Format
from ..gpus import GpuSpec, match_detected

MAX_TIMED_GEMMS = 16  # distinct GEMMs timed in isolation for achieved TFLOP/s, largest first


#: Calls timed between one pair of CUDA events (docs/gpu.md, "GEMM timings").
CALLS_PER_TIMING = 10


def _time_callable(fn: Callable[[], Any], repeats: int = 5, calls: int = CALLS_PER_TIMING) -> float:
    """Median seconds of one ``fn()`` on the current CUDA stream, after 3 warm-up calls.

    One pair of events brackets ``calls`` back-to-back calls, and the start event is queued behind one more call:
    an event recorded on an idle GPU fires at once, so a pair around a single call would also time the host's
    launch of that call (microseconds, the size of a small GEMM). Queued behind a running kernel, the start fires
    when the GPU is already busy with the calls to time; the launch gap left is spread over ``calls``."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()  # the GPU is busy when the start event is reached
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


def time_gemm(m: int, n: int, k: int, batch: int, dtype: torch.dtype, device: str, repeats: int = 5) -> float:
    """Median seconds of one ``[batch, m, k] @ [batch, k, n]`` on ``device`` (CUDA only)."""
    if not device.startswith("cuda"):
        raise ValueError("time_gemm needs a CUDA device")
    a = torch.randn(batch, m, k, device=device, dtype=dtype)
    b = torch.randn(batch, k, n, device=device, dtype=dtype)
    return _time_callable(lambda: torch.bmm(a, b), repeats)


def time_conv(spec: ConvSpec, dtype: torch.dtype, device: str, repeats: int = 5) -> float:
    """Median seconds of the convolution ``spec`` describes, on ``device`` (CUDA only)."""
    if not device.startswith("cuda"):
        raise ValueError("time_conv needs a CUDA device")
    x = torch.randn(spec.input, device=device, dtype=dtype)
    w = torch.randn(spec.weight, device=device, dtype=dtype)
    return _time_callable(lambda: torch.convolution(x, w, None, list(spec.stride), list(spec.padding),
                                                    list(spec.dilation), spec.transposed,
                                                    list(spec.output_padding), spec.groups), repeats)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def padded_conv(spec: ConvSpec, multiple: int) -> ConvSpec:
    """The convolution with its input and output channels (per group) padded to ``multiple``."""
    g = spec.groups
    if spec.transposed:  # weight [C_in, C_out / groups, *k]
        c_in, c_out_g = spec.weight[0], spec.weight[1]
        c_in_p = g * _round_up(c_in // g, multiple)
        weight = (c_in_p, _round_up(c_out_g, multiple), *spec.weight[2:])
    else:  # weight [C_out, C_in / groups, *k]
        c_out, c_in_g = spec.weight[0], spec.weight[1]
        c_in_p = g * _round_up(c_in_g, multiple)
        weight = (g * _round_up(c_out // g, multiple), _round_up(c_in_g, multiple), *spec.weight[2:])
    return dataclasses.replace(spec, input=(spec.input[0], c_in_p, *spec.input[2:]), weight=weight)


def conv_flops(spec: ConvSpec) -> int:
    out = _conv_out_shape(spec)
    return int(flop_counter.conv_flop_count(list(spec.input), list(spec.weight), list(out),
                                            transposed=spec.transposed))


def _conv_out_shape(spec: ConvSpec) -> tuple[int, ...]:
    sizes = []
    for i, n in enumerate(spec.input[2:]):
        k, s, p, d = spec.weight[2 + i], spec.stride[i], spec.padding[i], spec.dilation[i]
        if spec.transposed:
            sizes.append((n - 1) * s - 2 * p + d * (k - 1) + spec.output_padding[i] + 1)
        else:
            sizes.append((n + 2 * p - d * (k - 1) - 1) // s + 1)
    c_out = spec.weight[1] * spec.groups if spec.transposed else spec.weight[0]
    return (spec.input[0], c_out, *sizes)


def measured_gpu(device: str) -> tuple[str, GpuSpec | None]:
    """The name of the GPU ``device`` is, and its table row (``None`` when it is not in the table)."""
    props = torch.cuda.get_device_properties(device)
    return str(props.name), match_detected(str(props.name), (int(props.major), int(props.minor)),
                                           int(props.total_memory))


class GemmTimer:
    """Times GEMMs and convolutions on one GPU, each distinct shape and dtype once.

    Example::

        timer = GemmTimer("cuda")
        timer.measure(gemm_op, torch.bfloat16)   # {"measured_s": ..., "achieved_tflops": ..., ...}
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.gpu_name, self.gpu = measured_gpu(device)
        self._cache: dict[tuple, float] = {}
        self.timed = 0  # distinct timings actually run

    def _seconds(self, key: tuple, run: Callable[[], float]) -> float:
        if key not in self._cache:
            self._cache[key] = run()
            self.timed += 1
        return self._cache[key]

    def _verdict(self, achieved: float) -> tuple[str | None, str | None]:
        peak = self.gpu.peak("fp32") if self.gpu is not None else None
        if not peak:
            return None, (f"not judged: {self.gpu_name} is not in the GPU table, so its FP32 non-Tensor-Core "
                          "peak is unknown")
        verdict = ("Tensor Cores in use: faster than the FP32 non-Tensor-Core peak" if achieved > peak
                   else "no evidence of Tensor Cores: not faster than the FP32 non-Tensor-Core peak "
                        "(small or latency-bound GEMMs look like this too)")
        return verdict, f"{self.gpu_name} (measured): FP32 non-Tensor-Core peak {peak:g} TFLOP/s"

    def measure(self, g: GemmOp, dtype: torch.dtype, pad_to: int | None = None) -> dict[str, Any]:
        """Achieved TFLOP/s of ``g`` (padded to a multiple of ``pad_to`` when given) and the Tensor Core verdict."""
        if g.kind == "conv" and g.conv is not None:
            spec = padded_conv(g.conv, pad_to) if pad_to else g.conv
            t = self._seconds(("conv", spec, dtype), lambda: time_conv(spec, dtype, self.device))
            flops = conv_flops(spec)
            timed_as = {"op": "convolution", "input": list(spec.input), "weight": list(spec.weight),
                        "stride": list(spec.stride), "padding": list(spec.padding), "groups": spec.groups}
        else:
            m, n, k = ((_round_up(v, pad_to) if pad_to and v > 1 else v) for v in (g.m, g.n, g.k))
            t = self._seconds(("bmm", m, n, k, g.batch, dtype),
                              lambda: time_gemm(m, n, k, g.batch, dtype, self.device))
            flops = 2 * g.batch * m * n * k
            timed_as = {"op": "bmm" if g.kind != "attention" else "bmm (the attention's QK^T GEMM)",
                        "m": m, "n": n, "k": k, "batch": g.batch}
        achieved = flops / t / 1e12 if t > 0 else math.inf
        verdict, judged = self._verdict(achieved)
        return {"measured_s": t, "achieved_tflops": achieved if math.isfinite(achieved) else None,
                "tensor_cores": verdict, "judged_against": judged, "timed_as": timed_as}


def measure_gemms(capture: Any, perf: Any, target: GpuSpec, device: str, formats: tuple[Format, ...]) -> None:
    """Attach measured times to the audit: the largest distinct GEMMs (achieved TFLOP/s) and each misaligned
    GEMM or convolution of an alignment finding, as is and padded (CUDA only)."""
    from .alignment import REQUIRED_MULTIPLE

    fmt = Format.BF16 if Format.BF16 in formats else (formats[0] if formats else None)
    if fmt is None:
        return
    dtype = LOW_PRECISION_DTYPES[fmt]
    timer = GemmTimer(device)
    distinct: dict[tuple, tuple[str, GemmOp]] = {}
    for rec in capture.layers:
        for g, _ in rec.ops.gemms.values():
            if g.kind == "matmul":
                distinct.setdefault((g.m, g.n, g.k, g.batch), (rec.name, g))
    largest = sorted(distinct.values(), key=lambda ng: -ng[1].flops)[:MAX_TIMED_GEMMS]
    for name, g in largest:
        lp = perf.layers.get(name)
        if lp is not None and lp.cost is not None:
            lp.cost.measured_gemms.append(
                {"format": fmt.value, "gemm": {"m": g.m, "n": g.n, "k": g.k, "batch": g.batch},
                 **timer.measure(g, dtype), "peak_tflops": target.peak(fmt.value)})
    for rec in capture.layers:
        lp = perf.layers.get(rec.name)
        if lp is None:
            continue
        gemms = {(g.m, g.n, g.k, g.batch): g for g, _ in rec.ops.gemms.values()}
        for finding in lp.alignment:
            shape = finding.get("gemm")
            if not shape:
                continue
            g = gemms.get((shape["m"], shape["n"], shape["k"], shape["batch"]))
            if g is None:
                continue
            finding["measured"] = {"format": fmt.value, "as_is": timer.measure(g, dtype),
                                   "padded": timer.measure(g, dtype, pad_to=REQUIRED_MULTIPLE[fmt]),
                                   "measured_on": timer.gpu_name}
