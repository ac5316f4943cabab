"""A roofline cost model of the target GPU, from the ops that ran, with a per-kernel floor. Every figure it gives
is an estimate.

roofline(GEMM) = max(FLOPs / (peak x achievable share x tile-and-wave efficiency), bytes / achievable bandwidth),
x ALIGNMENT_PENALTY when a dimension breaks the format's vector-width rule, and never less than the same GEMM padded;
roofline(other op) = bytes / achievable bandwidth. The achievable shares of the datasheet peaks are the calibration
(:func:`achievable_share`, BANDWIDTH_SHARE; docs/gpu.md, "The cost model's calibration", with the figures behind
each constant). A training step is forward + backward: the backward of a GEMM is two GEMMs of the same size
(grad input, grad weight), the backward of any other op one kernel moving twice the forward's bytes, so
without the floor a step is 3 x the forward's roofline. Every kernel takes max(roofline, KERNEL_FLOOR_S): a
small kernel costs its launch however little it does (docs/report.md, "The cost model's floor"), so a step is
never estimated below (kernels run) x KERNEL_FLOOR_S.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..capture.ops import GemmOp, ModuleOps
from ..formats import Format
from ..gpus import GpuSpec
from .alignment import TILE, is_aligned, padded

# A misaligned dimension makes cuBLAS pick kernels with narrower vector loads. NVIDIA's guide gives no single
# factor; a report of a misaligned LM head (vocab 128003) running ~3x slower than padded (Netflix tech blog,
# 2026-02-13, via a secondary summary) is the worst case we know of. 2x is our heuristic, and it is labelled as
# such in the outputs.
ALIGNMENT_PENALTY = 2.0
STEP_OVER_FORWARD = 3.0  # without the floor: forward + backward = 3 x forward (GEMMs and bytes alike)
#: A heuristic, labelled as one in the outputs: the least time one CUDA kernel takes in an eager training step,
#: however little it does. Launching a kernel costs the host about 4-6 µs and back-to-back kernels run about
#: 1 µs apart on the GPU (docs/report.md, "The cost model's floor", with sources); 4 µs is a launch-bound eager
#: step's pace. The one constant for every estimate here and in fp8/cost.py.
KERNEL_FLOOR_S = 4e-6
#: Kernels the backward runs per forward kernel (heuristic): a GEMM's grad input and grad weight; one kernel
#: for any other op (its bias, norm-parameter and reduction gradients are not counted: the floor stays a floor).
BACKWARD_GEMM_KERNELS = 2
BACKWARD_OTHER_KERNELS = 1

#: The calibration (docs/gpu.md, "The cost model's calibration": which figures are measured, which assumed).
#: Share of the datasheet dense peak a large Tensor Core GEMM reaches (fp16, bf16, tf32, fp8): assumed.
TENSOR_CORE_SHARE = 0.75
#: Share of the FP32 non-Tensor-Core peak a large FP32 GEMM reaches (TF32 off: cuBLAS's SIMT SGEMM): assumed.
CUDA_CORE_SHARE = 0.85
#: The main-loop length at which a GEMM reaches half its large-size share, at the BF16 Tensor Core peak: each
#: output tile pays a fixed cost (filling the pipeline, writing the tile) worth this much K of work. Fitted to the
#: H200's bf16 GEMM of 1024 x 50264 x 256 timed at 345 TFLOP/s (bench/README.md, "On a GPU"). The fixed cost is
#: time, so a format's half-share length scales with its peak (FP32 on CUDA cores: about 22 on an H100).
K_HALF_AT_BF16_PEAK = 290.0
#: Share of the datasheet memory bandwidth that streaming kernels reach: assumed.
BANDWIDTH_SHARE = 0.80

ELEMENT_BYTES = {Format.FP32: 4, Format.TF32: 4, Format.BF16: 2, Format.FP16: 2,
                 Format.FP8_E4M3: 1, Format.FP8_E5M2: 1}

ASSUMPTIONS = (
    "roofline per op over the target's dense peak and memory bandwidth (gpus.py, with sources), at the achievable "
    f"shares of the calibration: GEMMs {TENSOR_CORE_SHARE:.0%} of the Tensor Core peak ({CUDA_CORE_SHARE:.0%} of "
    f"the FP32 one) x K / (K + K_half), K_half {K_HALF_AT_BF16_PEAK:g} at the BF16 peak and scaled by the peak; "
    f"{BANDWIDTH_SHARE:.0%} of the bandwidth (docs/gpu.md)",
    f"output tiles of {TILE}x{TILE} (or 64 for dimensions under {TILE}), one tile per SM per wave",
    f"a dimension off the format's vector-width rule costs {ALIGNMENT_PENALTY:g}x (heuristic), "
    "never less than padding it",
    f"step = forward + backward: {BACKWARD_GEMM_KERNELS} GEMMs of the same size per forward GEMM, "
    f"{BACKWARD_OTHER_KERNELS} kernel moving twice the bytes per other forward op",
    "FP32 GEMMs at the non-Tensor-Core FP32 peak (torch's default: TF32 off for matmuls)",
    f"every kernel (those counted: one per compute op the forward ran, and the backward's as above) takes at least "
    f"{KERNEL_FLOOR_S * 1e6:g} µs (heuristic: launch-bound eager execution; CUDA graphs or torch.compile cut it), "
    "so a small model's step is bound by its kernel count; copies and autocast's casts are not counted as kernels",
    "fp16/bf16: each non-GEMM op at the widths CUDA autocast gives its tensors (softmax, norms, an fp32 residual "
    "stream at 4 bytes), and autocast's casts of each GEMM's fp32 operands (forward, and the gradient's back) "
    "priced with the GEMM, by their bytes; the ops outside the model's modules (the loss) are part of the step",
    "no overlap between ops",
)


def peak_flops(target: GpuSpec, fmt: Format) -> float:
    p = target.peak(fmt.value)
    if p is None:
        raise ValueError(f"{target.name} has no {fmt} peak")
    return p * 1e12


def _tile(d: int) -> int:
    return TILE if d >= TILE else 64


def achievable_share(g: GemmOp, fmt: Format, target: GpuSpec) -> float:
    """Share of ``fmt``'s datasheet peak that ``g`` can reach, before tile and wave quantization: the large-size
    share of its units (Tensor Cores, or CUDA cores for FP32) x L / (L + L_half), L the length of each output
    tile's main loop (K; the key length for an attention, whose fused kernel loops over the keys) and L_half the
    length whose work equals the tile's fixed cost (K_HALF_AT_BF16_PEAK x this format's peak / the BF16 one)."""
    base = CUDA_CORE_SHARE if fmt is Format.FP32 else TENSOR_CORE_SHARE
    ref = target.peak(Format.BF16.value) or target.peak(Format.FP16.value) or target.peak(fmt.value)
    half = K_HALF_AT_BF16_PEAK * (target.peak(fmt.value) or 0.0) / ref if ref else 0.0
    loop = g.n if g.kind == "attention" else g.k
    return base * loop / (loop + half) if loop > 0 else base


def gemm_efficiency(g: GemmOp, target: GpuSpec) -> float:
    """Useful share of the output tiles x share of the last wave that is busy."""
    tm, tn = _tile(g.m), _tile(g.n)
    tiles = g.batch * math.ceil(g.m / tm) * math.ceil(g.n / tn)
    waves = math.ceil(tiles / target.sms)
    tile_eff = (g.batch * g.m * g.n) / (tiles * tm * tn)
    wave_eff = tiles / (waves * target.sms)
    return tile_eff * wave_eff


def _raw_gemm_time(g: GemmOp, fmt: Format, target: GpuSpec) -> float:
    compute = g.flops / (peak_flops(target, fmt) * achievable_share(g, fmt, target) * gemm_efficiency(g, target))
    nbytes = g.batch * (g.m * g.k + g.k * g.n + g.m * g.n) * ELEMENT_BYTES[fmt]
    return max(compute, bytes_time(nbytes, target))


def gemm_time(g: GemmOp, fmt: Format, target: GpuSpec) -> float:
    """Estimated forward time of one GEMM-family op in ``fmt`` on ``target`` (seconds). One that autocast does not
    lower (``g.lowered`` False) runs in FP32 under fp16/bf16 autocast, and is priced so."""
    if not g.lowered and fmt in (Format.FP16, Format.BF16):
        fmt = Format.FP32
    t = _raw_gemm_time(g, fmt, target)
    if fmt in (Format.FP32,) or is_aligned(g, fmt):
        return t
    return max(t * ALIGNMENT_PENALTY, _raw_gemm_time(padded(g, fmt), fmt, target))


def bytes_time(nbytes: float, target: GpuSpec) -> float:
    """Seconds to move ``nbytes`` at the achievable share of the target's bandwidth."""
    return nbytes / (target.bandwidth_gbps * 1e9 * BANDWIDTH_SHARE)


def floor() -> float:
    """The per-kernel floor in force: KERNEL_FLOOR_S, read when called (a test of plan logic on a toy model
    may set it to 0, where every plan would otherwise tie at the floor)."""
    return KERNEL_FLOOR_S


def kernel_time(roofline_s: float, floor_s: float | None = None) -> float:
    """One kernel's estimated time: its roofline, never below the per-kernel floor."""
    return max(roofline_s, floor() if floor_s is None else floor_s)


def gemm_step_time(g: GemmOp, fmt: Format, target: GpuSpec, floor_s: float | None = None) -> float:
    """Forward + backward of one call of ``g``: 1 + BACKWARD_GEMM_KERNELS GEMMs of its size, each floored. Under
    fp16/bf16 autocast the casts of its fp32 operands (``g.cast_bytes``) go with the forward GEMM, and those of
    their gradients back with one backward GEMM, before the floor: a cast kernel is not counted as a kernel."""
    t = gemm_time(g, fmt, target)
    if g.cast_bytes and g.lowered and fmt in (Format.FP16, Format.BF16):
        cast = bytes_time(g.cast_bytes, target)
        return 2 * kernel_time(t + cast, floor_s) + (BACKWARD_GEMM_KERNELS - 1) * kernel_time(t, floor_s)
    return (1 + BACKWARD_GEMM_KERNELS) * kernel_time(t, floor_s)


def other_step_time(elements: int, element_bytes: int, target: GpuSpec, floor_s: float | None = None) -> float:
    """Forward + backward of one non-GEMM op that read and wrote ``elements``: the forward kernel moves their
    bytes, the backward's kernel(s) twice as many; each kernel floored."""
    fwd = bytes_time(elements * element_bytes, target)
    bwd = (STEP_OVER_FORWARD - 1) * fwd / BACKWARD_OTHER_KERNELS
    return kernel_time(fwd, floor_s) + BACKWARD_OTHER_KERNELS * kernel_time(bwd, floor_s)


def step_kernels(ops: ModuleOps) -> int:
    """Kernels a module's own ops run in one training step (forward as executed, backward estimated)."""
    gemm_calls = sum(c for _, c in ops.gemms.values())
    return gemm_calls * (1 + BACKWARD_GEMM_KERNELS) + ops.other_ops * (1 + BACKWARD_OTHER_KERNELS)


@dataclass(frozen=True)
class LayerCost:
    flops: int  # forward FLOPs of its own GEMMs
    gemm_step_s: float  # forward + backward, each kernel floored
    other_bytes: int  # forward
    other_step_s: float  # forward + backward, each kernel floored
    kernels: int  # per step (step_kernels)
    floor_s: float  # the per-kernel floor it was estimated with

    @property
    def step_time_s(self) -> float:
        return self.gemm_step_s + self.other_step_s

    @property
    def floor_total_s(self) -> float:
        """The least its step can be estimated at: its kernels x the floor."""
        return self.kernels * self.floor_s


def layer_cost(ops: ModuleOps, fmt: Format, target: GpuSpec, activation_bytes: int,
               floor_s: float | None = None) -> LayerCost:
    """Cost of what a module computed itself; ``activation_bytes`` is the element size its non-GEMM ops use, where
    the capture did not record what each would move under fp16/bf16 autocast (``ops.other_low_bytes``: then the
    fp16/bf16 estimate prices each op at its own widths, the fp32 ones of softmax, norms or a residual stream too).

    Each kernel is priced on its own (capture/ops.py keeps every non-GEMM op's element count), so a module of
    many tiny ops costs its kernel count x the floor, not its bytes over the bandwidth."""
    floor_s = floor() if floor_s is None else floor_s
    gt = sum(gemm_step_time(g, fmt, target, floor_s) * c for g, c in ops.gemms.values())
    if fmt in (Format.FP16, Format.BF16) and ops.other_low_bytes:
        ot = sum(other_step_time(b, 1, target, floor_s) * c for b, c in ops.other_low_bytes.items())
        other_bytes = sum(b * c for b, c in ops.other_low_bytes.items())
    else:
        ot = sum(other_step_time(e, activation_bytes, target, floor_s) * c for e, c in ops.other_sizes.items())
        other_bytes = ops.other_elements * activation_bytes
    return LayerCost(ops.gemm_flops, gt, other_bytes, ot, step_kernels(ops), floor_s)


def alignment_time_lost(g: GemmOp, fmt: Format, target: GpuSpec, batch_dims: frozenset[str]) -> tuple[float, float]:
    """Forward time of ``g`` lost to misalignment in ``fmt``, split as (dimensions set by the batch, the
    model's own). The penalty is all-or-nothing (any misaligned dimension costs it), so neither padding alone
    need save anything; each side gets the average of what it saves padded first and padded second (the
    two-party Shapley split), and the two add up to what padding both saves (docs/report.md "Alignment")."""
    from .alignment import REQUIRED_MULTIPLE, pad_only

    req = REQUIRED_MULTIPLE.get(fmt)
    if req is None:
        return 0.0, 0.0
    bad = {d for d, _, s in g.dims if s > 1 and s % req}
    if not bad:
        return 0.0, 0.0
    t = gemm_time(g, fmt, target)
    batch, model = bad & batch_dims, bad - batch_dims
    t_all = gemm_time(pad_only(g, fmt, bad), fmt, target)
    if not batch or not model:
        lost = max(0.0, t - t_all)
        return (lost, 0.0) if batch else (0.0, lost)
    t_batch = gemm_time(pad_only(g, fmt, batch), fmt, target)  # only the batch's padded
    t_model = gemm_time(pad_only(g, fmt, model), fmt, target)  # only the model's padded
    lost_batch = ((t - t_batch) + (t_model - t_all)) / 2
    lost_model = ((t - t_model) + (t_batch - t_all)) / 2
    return max(0.0, lost_batch), max(0.0, lost_model)
