"""Tensor Core alignment of the GEMMs that actually ran (NUMERICS.md §4, NVIDIA DL Performance Guide).

Since cuBLAS 11 / cuDNN 7.6.3 a misaligned dimension costs speed, not Tensor Core eligibility: findings state
a cost, never "not eligible". Rules, in elements (the guide's 16-byte rule): FP16/BF16 multiples of 8, TF32 of
4, FP8 of 16; on A100 and later the efficient tier is 128 bytes: 64 / 32 / 128 elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..capture.ops import GemmOp
from ..formats import Format

# Required multiple in elements per format (16 bytes / element size): NVIDIA "Matrix Multiplication
# Background" guide, Table 1 (cuBLAS >= 11: "always but most efficient with multiples of ...").
REQUIRED_MULTIPLE: dict[Format, int] = {Format.FP16: 8, Format.BF16: 8, Format.TF32: 4,
                                        Format.FP8_E4M3: 16, Format.FP8_E5M2: 16}
# The efficient tier on A100 and later (128 bytes): same table, "on A100, multiples of 64 / 32 / 128".
EFFICIENT_MULTIPLE: dict[Format, int] = {Format.FP16: 64, Format.BF16: 64, Format.TF32: 32,
                                         Format.FP8_E4M3: 128, Format.FP8_E5M2: 128}
# Output tile edge used for tile-quantization waste (typical cuBLAS tiles are 128 or 256 wide; NUMERICS §4.2).
TILE = 128


def round_up(x: int, multiple: int) -> int:
    return int(math.ceil(x / multiple) * multiple)


def tile_waste_pct(size: int, tile: int = TILE) -> float:
    """Share of the last tile row/column that does no useful work (N=136 on 128-wide tiles: 2 tiles, 46.9%)."""
    padded = round_up(size, tile)
    return 100.0 * (padded - size) / padded


@dataclass(frozen=True)
class DimFinding:
    dim: str  # "M", "N", "K", "C", "E"
    name: str  # what a person calls it
    size: int
    required_multiple: int
    suggested_size: int
    efficient_multiple: int | None
    efficient_size: int | None
    aligned: bool
    efficient: bool
    tile_waste_pct: float | None


def check_dims(g: GemmOp, fmt: Format, efficient_tier: bool) -> list[DimFinding]:
    """Every named dimension of ``g`` against ``fmt``'s rule on a target with or without the efficient tier."""
    req = REQUIRED_MULTIPLE[fmt]
    eff = EFFICIENT_MULTIPLE[fmt] if efficient_tier else None
    out = []
    for dim, name, size in g.dims:
        if size <= 1:
            continue
        out.append(DimFinding(
            dim=dim, name=name, size=size, required_multiple=req, suggested_size=round_up(size, req),
            efficient_multiple=eff, efficient_size=round_up(size, eff) if eff else None,
            aligned=size % req == 0, efficient=(size % eff == 0) if eff else size % req == 0,
            tile_waste_pct=tile_waste_pct(size) if dim in ("M", "N", "C_out") else None,
        ))
    return out


def padded(g: GemmOp, fmt: Format) -> GemmOp:
    """The same GEMM with its dimensions padded to ``fmt``'s required multiple."""
    req = REQUIRED_MULTIPLE[fmt]
    m, n, k = (round_up(v, req) if v > 1 else v for v in (g.m, g.n, g.k))
    flops = int(g.flops * (m * n * k) / max(1, g.m * g.n * g.k))
    dims = tuple((d, name, round_up(s, req) if s > 1 else s) for d, name, s in g.dims)
    return GemmOp(g.op, g.kind, m, n, k, g.batch, flops, dims, g.note)


def is_aligned(g: GemmOp, fmt: Format) -> bool:
    req = REQUIRED_MULTIPLE.get(fmt)
    if req is None:
        return True
    return all(size % req == 0 or size <= 1 for _, _, size in g.dims)


def vocabulary_advice(size: int) -> str:
    """The padding the big language-model codebases use (nanoGPT: 64, Megatron: 128)."""
    return (f"pad the vocabulary from {size} to {round_up(size, 64)} (a multiple of 64, as nanoGPT pads GPT-2's "
            f"50257 to 50304) or {round_up(size, 128)} (Megatron's default multiple of 128); the extra rows are "
            "never the target of a label")
