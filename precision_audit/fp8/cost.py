"""Estimated step time of one linear layer per FP8 recipe on the target, against BF16 (docs/fp8.md, "Speed").

Per training step a linear layer of T tokens, K inputs and N outputs runs three GEMMs (output T x N x K,
grad_input T x K x N, grad_weight N x K x T). Each runs at the recipe's Tensor Core peak (FP8; BF16 where the
recipe keeps it in high precision) times the tile-and-wave efficiency of analysis/cost.py, or at memory
bandwidth when that is slower. The recipe adds memory-bound kernels: amax reductions and casts of the input,
weight and output gradient, priced as bytes moved at the target's bandwidth (CAST_BYTES). FP8 GEMMs need K and N
multiples of 16 (torch._scaled_mm); a layer that breaks that is not convertible. Every figure is an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..analysis.cost import KERNEL_FLOOR_S, gemm_efficiency
from ..capture.ops import GemmOp
from ..gpus import GpuSpec
from ..record.fp8 import Fp8RecipeCost
from .recipes import RECIPES

#: bytes moved per element of each of the three tensors (input, weight, grad_output; BF16 in, 2 bytes) by the
#: amax and cast kernels a recipe adds in one step (docs/fp8.md, "Speed", states how each figure is made up)
CAST_BYTES = {
    "fp8_tensorwise": 8.0,  # amax (read 2) + one cast per GEMM the tensor feeds (2 x (read 2 + write 1))
    "fp8_rowwise": 10.0,  # per GEMM its own axis: 2 x (amax read 2 + cast read 2 + write 1)
    "fp8_rowwise_gw_hp": 20.0 / 3,  # input 5, weight 10, grad_output 5: the weight-gradient GEMM needs no cast
    "fp8_delayed": 4.0,  # TE's fused cast + transpose with the amax of the known scale: read 2, write 2 x 1
    "mxfp8": 4.0625,  # one read, both block directions written: read 2 + 2 x (1 + 1/32 scale)
    "nvfp4": 5.125,  # per-tensor amax (read 2) + read 2, both directions: 2 x (0.5 + 1/16 scale)
}
#: extra kernels a recipe launches per layer and step (amax reductions and casts; Transformer Engine fuses amax,
#: cast and transpose into one kernel per tensor), each costing at least KERNEL_LAUNCH_S
EXTRA_KERNELS = {"fp8_tensorwise": 9, "fp8_rowwise": 12, "fp8_rowwise_gw_hp": 8, "fp8_delayed": 3, "mxfp8": 3,
                 "nvfp4": 6}
#: A heuristic, labelled as one in the outputs: the few microseconds a small CUDA kernel takes however little it
#: does (launch and tail). It is what makes a small GEMM not worth converting: its casts cost more than it saves.
#: The cost model's one per-kernel floor (analysis/cost.py; docs/report.md, "The cost model's floor").
KERNEL_LAUNCH_S = KERNEL_FLOOR_S
ASSUMPTIONS = (
    "three GEMMs per step (output, grad_input, grad_weight), each at the recipe's dense peak x tile-and-wave "
    "efficiency, or at memory bandwidth if slower",
    "amax and cast kernels as bytes moved at the target's bandwidth (fp8/cost.py CAST_BYTES), inputs in BF16",
    f"each extra amax/cast kernel costs at least {KERNEL_LAUNCH_S * 1e6:g} us (heuristic: launch and tail); "
    "no overlap; the BF16 baseline has no casts",
    "FP8 GEMMs need K and N multiples of 16 (torch._scaled_mm); MXFP8/NVFP4 need K a multiple of the block",
)


@dataclass(frozen=True)
class LayerCost:
    recipe: str
    bf16_time_s: float
    gemm_time_s: float | None
    cast_time_s: float | None
    convertible: bool
    note: str = ""

    @property
    def time_s(self) -> float | None:
        return None if self.gemm_time_s is None or self.cast_time_s is None else self.gemm_time_s + self.cast_time_s

    @property
    def speedup(self) -> float | None:
        t = self.time_s
        return self.bf16_time_s / t if t else None

    @property
    def pays(self) -> bool:
        s = self.speedup
        return self.convertible and s is not None and s > 1.0

    def to_record(self) -> Fp8RecipeCost:
        """audit.json's ``fp8.plan.modules[].cost[recipe]``."""
        return Fp8RecipeCost(bf16_time_s=self.bf16_time_s, gemm_time_s=self.gemm_time_s,
                             cast_time_s=self.cast_time_s, time_s=self.time_s, speedup_vs_bf16=self.speedup,
                             convertible=self.convertible, pays=self.pays, note=self.note or None)


def _gemm(m: int, n: int, k: int) -> GemmOp:
    return GemmOp("mm", "matmul", m, n, k, 1, 2 * m * n * k, (("M", "", m), ("N", "", n), ("K", "", k)))


def _time(g: GemmOp, peak_tflops: float, in_bytes: float, target: GpuSpec) -> float:
    compute = g.flops / (peak_tflops * 1e12 * gemm_efficiency(g, target))
    nbytes = (g.m * g.k + g.k * g.n) * in_bytes + g.m * g.n * 2  # output in BF16
    return max(compute, nbytes / (target.bandwidth_gbps * 1e9))


def _gemms(tokens: int, k: int, n: int) -> dict[str, GemmOp]:
    return {"output": _gemm(tokens, n, k), "grad_input": _gemm(tokens, k, n), "grad_weight": _gemm(n, k, tokens)}


def layer_cost(tokens: int, in_features: int, out_features: int, recipe: str, target: GpuSpec) -> LayerCost:
    """Estimated step time of a linear layer under ``recipe`` and under BF16 on ``target``."""
    r = RECIPES[recipe]
    gemms = _gemms(tokens, in_features, out_features)
    bf16 = target.peak("bf16") or target.peak("fp16")
    bf16_t = sum(_time(g, bf16, 2, target) for g in gemms.values()) if bf16 else float("nan")
    if tuple(target.compute_capability) < r.min_cc:
        return LayerCost(recipe, bf16_t, None, None, False,
                         f"not estimated: {target.name} "
                         f"(CC {target.compute_capability[0]}.{target.compute_capability[1]})"
                         f" has no Tensor Cores for {recipe} (CC {r.min_cc[0]}.{r.min_cc[1]} or later)")
    peak_name = "fp8_e4m3"
    elem_bytes = 1.0
    if recipe == "nvfp4":
        peak = target.peak("fp4") if "fp4" in getattr(target, "peak_tflops", {}) else None
        if peak is None:
            return LayerCost(recipe, bf16_t, None, None, False,
                             f"not estimated: no FP4 Tensor Core peak for {target.name} in gpus.py")
        elem_bytes = 0.5625
    else:
        peak = target.peak(peak_name)
    if peak is None:
        return LayerCost(recipe, bf16_t, None, None, False, f"not estimated: {target.name} has no FP8 peak")
    convertible, note = True, ""
    mult = r.block or 16
    if in_features % mult or out_features % mult:
        convertible, note = False, (f"in/out features {in_features}x{out_features} are not multiples of {mult} "
                                    f"({'torch._scaled_mm' if not r.block else 'the block size'})")
    t = 0.0
    for name, g in gemms.items():
        hp = r.cast(name, "input" if name != "grad_input" else "grad_output").kind == "hp"
        if hp:  # a GEMM the recipe keeps in BF16 (not estimated without a BF16/FP16 peak, as bf16_t)
            t += _time(g, bf16, 2, target) if bf16 else float("nan")
        else:
            t += _time(g, peak, elem_bytes, target)
    elements = tokens * in_features + in_features * out_features + tokens * out_features
    cast_t = max(CAST_BYTES[recipe] * elements / (target.bandwidth_gbps * 1e9),
                 EXTRA_KERNELS[recipe] * KERNEL_LAUNCH_S)
    return LayerCost(recipe, bf16_t, t, cast_t, convertible, note)


def torchao_auto_filter(in_features: int, out_features: int, recipe: str) -> bool | None:
    """torchao 0.18's ``_auto_filter_for_recipe`` verdict (what torchtitan's ``auto_filter`` uses): True when it
    would convert the layer; None for recipes it has no filter for. Restated here so that the comparison runs
    without torchao (torchao/float8/float8_linear_utils.py, thresholds from its H100 benchmarks)."""
    n, k = out_features, in_features
    if k % 16 or n % 16:
        return False
    if recipe == "fp8_tensorwise":
        return not (k <= 4096 and n <= 1024)
    if recipe == "fp8_rowwise":
        return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))
    return None
