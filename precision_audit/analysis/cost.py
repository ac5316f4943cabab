"""A roofline cost model of the target GPU, from the shapes that ran. Every figure it gives is an estimate.

time(GEMM) = max(FLOPs / (peak x tile-and-wave efficiency), bytes / bandwidth), x ALIGNMENT_PENALTY when a
dimension breaks the format's vector-width rule, and never less than the same GEMM padded; time(other op) =
bytes / bandwidth. A training step is taken as forward + backward = 3 x forward (the backward of a GEMM is two
GEMMs of the same size; elementwise backward moves about twice the forward's bytes).
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
STEP_OVER_FORWARD = 3.0

ELEMENT_BYTES = {Format.FP32: 4, Format.TF32: 4, Format.BF16: 2, Format.FP16: 2,
                 Format.FP8_E4M3: 1, Format.FP8_E5M2: 1}

ASSUMPTIONS = (
    "roofline per op over the target's dense peak and memory bandwidth (gpus.py, with sources)",
    f"output tiles of {TILE}x{TILE} (or 64 for dimensions under {TILE}), one tile per SM per wave",
    f"a dimension off the format's vector-width rule costs {ALIGNMENT_PENALTY:g}x (heuristic), "
    "never less than padding it",
    f"step = forward + backward = {STEP_OVER_FORWARD:g} x forward",
    "FP32 GEMMs at the non-Tensor-Core FP32 peak (torch's default: TF32 off for matmuls)",
    "no kernel-launch latency and no overlap between ops",
)


def peak_flops(target: GpuSpec, fmt: Format) -> float:
    p = target.peak(fmt.value)
    if p is None:
        raise ValueError(f"{target.name} has no {fmt} peak")
    return p * 1e12


def _tile(d: int) -> int:
    return TILE if d >= TILE else 64


def gemm_efficiency(g: GemmOp, target: GpuSpec) -> float:
    """Useful share of the output tiles x share of the last wave that is busy."""
    tm, tn = _tile(g.m), _tile(g.n)
    tiles = g.batch * math.ceil(g.m / tm) * math.ceil(g.n / tn)
    waves = math.ceil(tiles / target.sms)
    tile_eff = (g.batch * g.m * g.n) / (tiles * tm * tn)
    wave_eff = tiles / (waves * target.sms)
    return tile_eff * wave_eff


def _raw_gemm_time(g: GemmOp, fmt: Format, target: GpuSpec) -> float:
    compute = g.flops / (peak_flops(target, fmt) * gemm_efficiency(g, target))
    nbytes = g.batch * (g.m * g.k + g.k * g.n + g.m * g.n) * ELEMENT_BYTES[fmt]
    return max(compute, nbytes / (target.bandwidth_gbps * 1e9))


def gemm_time(g: GemmOp, fmt: Format, target: GpuSpec) -> float:
    """Estimated forward time of one GEMM-family op in ``fmt`` on ``target`` (seconds)."""
    t = _raw_gemm_time(g, fmt, target)
    if fmt in (Format.FP32,) or is_aligned(g, fmt):
        return t
    return max(t * ALIGNMENT_PENALTY, _raw_gemm_time(padded(g, fmt), fmt, target))


def bytes_time(nbytes: float, target: GpuSpec) -> float:
    return nbytes / (target.bandwidth_gbps * 1e9)


@dataclass(frozen=True)
class LayerCost:
    flops: int  # forward FLOPs of its own GEMMs
    gemm_time_s: float  # forward
    other_bytes: int
    other_time_s: float  # forward

    @property
    def step_time_s(self) -> float:
        return STEP_OVER_FORWARD * (self.gemm_time_s + self.other_time_s)


def layer_cost(ops: ModuleOps, fmt: Format, target: GpuSpec, activation_bytes: int) -> LayerCost:
    """Cost of what a module computed itself; ``activation_bytes`` is the element size its non-GEMM ops use."""
    gt = sum(gemm_time(g, fmt, target) * c for g, c in ops.gemms.values())
    ob = ops.other_elements * activation_bytes
    return LayerCost(ops.gemm_flops, gt, ob, bytes_time(ob, target))


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
