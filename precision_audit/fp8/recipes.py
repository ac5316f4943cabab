"""The FP8 / block-scaled training recipes, as the libraries that ship them define them (docs/fp8.md).

A linear layer runs three GEMMs per training step; a recipe says how each operand of each is quantised:

- ``output      = input @ weight.T``          (reduction over in_features)
- ``grad_input  = grad_output @ weight``      (reduction over out_features)
- ``grad_weight = grad_output.T @ input``     (reduction over the tokens)

Axiswise (rowwise) and block scales run along each GEMM's reduction dimension, as torchao and cuBLAS need them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant import E4M3, E5M2

GEMMS = ("output", "grad_input", "grad_weight")
#: (operand role, the dimension of the 2-D operand that is the reduction dimension of that GEMM)
OPERANDS: dict[str, tuple[tuple[str, int], tuple[str, int]]] = {
    "output": (("input", -1), ("weight", -1)),  # input (T, in), weight (out, in): reduce over in
    "grad_input": (("grad_output", -1), ("weight", 0)),  # grad_output (T, out), weight (out, in): over out
    "grad_weight": (("grad_output", 0), ("input", 0)),  # over the tokens T
}


@dataclass(frozen=True)
class Cast:
    """How one operand of one GEMM is quantised. ``kind``: ``"hp"`` (not quantised: the GEMM runs in high
    precision), ``"tensorwise"``, ``"axiswise"``, ``"delayed"``, ``"mx"``, ``"nvfp4"``."""

    kind: str
    dtype: torch.dtype | None = None
    pow2: bool = False

    def describe(self) -> str:
        if self.kind == "hp":
            return "high precision"
        names: dict[torch.dtype | None, str] = {E4M3: "e4m3", E5M2: "e5m2"}
        d = names.get(self.dtype, "e2m1")
        return f"{self.kind} {d}" + (" (power-of-2 scales)" if self.pow2 else "")


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    casts: dict[tuple[str, str], Cast]  # (gemm, operand role) -> cast
    min_cc: tuple[int, int]  # the compute capability whose Tensor Cores run it
    torchao_recipe: str | None = None  # Float8LinearConfig.from_recipe_name(...) where torchao has it
    block: int = 0  # element block size (MX, NVFP4)
    source: str = ""

    def cast(self, gemm: str, role: str) -> Cast:
        return self.casts[(gemm, role)]

    def quantised_gemms(self) -> tuple[str, ...]:
        return tuple(g for g in GEMMS if self.casts[(g, OPERANDS[g][0][0])].kind != "hp")


def _all(cast_fwd: Cast, cast_grad: Cast) -> dict[tuple[str, str], Cast]:
    out = {}
    for g, ((r1, _), (r2, _)) in OPERANDS.items():
        for r in (r1, r2):
            out[(g, r)] = cast_grad if r == "grad_output" else cast_fwd
    return out


_ROWWISE = _all(Cast("axiswise", E4M3, True), Cast("axiswise", E4M3, True))
_ROWWISE_GW_HP = dict(_ROWWISE)
_ROWWISE_GW_HP[("grad_input", "weight")] = Cast("tensorwise", E4M3, True)
_ROWWISE_GW_HP[("grad_weight", "grad_output")] = Cast("hp")
_ROWWISE_GW_HP[("grad_weight", "input")] = Cast("hp")

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("fp8_tensorwise", "FP8, one scale per tensor from its current amax; E4M3 forward, E5M2 gradients",
           _all(Cast("tensorwise", E4M3), Cast("tensorwise", E5M2)), (8, 9), "tensorwise",
           source="torchao Float8LinearConfig.from_recipe_name('tensorwise'); TE Float8CurrentScaling (HYBRID)"),
    Recipe("fp8_delayed", "FP8, one scale per tensor from the amax history of earlier steps (Transformer Engine "
           "DelayedScaling: HYBRID, history 1024, margin 0, max)",
           _all(Cast("delayed", E4M3), Cast("delayed", E5M2)), (8, 9), None,
           source="transformer_engine.common.recipe.DelayedScaling (current defaults)"),
    Recipe("fp8_rowwise", "FP8 E4M3, one power-of-two scale per row along each GEMM's reduction dimension",
           _ROWWISE, (8, 9), "rowwise", source="torchao Float8LinearConfig.from_recipe_name('rowwise')"),
    Recipe("fp8_rowwise_gw_hp", "rowwise FP8 for output and grad_input (grad_input's weight tensorwise); the "
           "weight gradient GEMM in high precision", _ROWWISE_GW_HP, (8, 9), "rowwise_with_gw_hp",
           source="torchao Float8LinearConfig.from_recipe_name('rowwise_with_gw_hp')"),
    Recipe("mxfp8", "MXFP8: E4M3 elements, one E8M0 scale per 32 elements along the reduction dimension "
           "(NVIDIA's rounded-up exponent)", _all(Cast("mx", E4M3), Cast("mx", E4M3)), (10, 0), None, block=32,
           source="OCP MX v1.0; TE MXFP8BlockScaling (E4M3 everywhere); cuBLAS block quantisation (RCEIL)"),
    Recipe("nvfp4", "NVFP4: E2M1 elements, one E4M3 scale per 16 elements plus one FP32 scale per tensor",
           _all(Cast("nvfp4"), Cast("nvfp4")), (10, 0), None, block=16,
           source="NVIDIA NVFP4 (torchao nvfp4_quantize); 1x16 blocks on every operand, round to nearest even"),
)}

DEFAULT_RECIPES = ("fp8_tensorwise", "fp8_delayed", "fp8_rowwise", "fp8_rowwise_gw_hp", "mxfp8", "nvfp4")


def get(name: str) -> Recipe:
    from ..errors import OptionError
    try:
        return RECIPES[name]
    except KeyError:
        raise OptionError(f"unknown FP8 recipe {name!r}", choices=list(RECIPES),
                          hint="see docs/fp8.md for what each recipe quantises") from None


def supported(recipe: Recipe, cc: tuple[int, int] | list[int] | None) -> bool:
    """Whether a target of compute capability ``cc`` has Tensor Cores for the recipe (FP8: 8.9 and later;
    MXFP8/NVFP4: 10.x)."""
    if cc is None:
        return False
    return tuple(cc) >= recipe.min_cc
