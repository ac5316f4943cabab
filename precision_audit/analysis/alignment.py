"""Tensor Core alignment of the GEMMs that actually ran (NVIDIA DL Performance Guide; docs/gpus.md, "Alignment
and tile quantization").

Since cuBLAS 11 / cuDNN 7.6.3 a misaligned dimension costs speed, not Tensor Core eligibility: findings state
a cost, never "not eligible". Rules, in elements (the guide's 16-byte rule): FP16/BF16 multiples of 8, TF32 of
4, FP8 of 16; on A100 and later the efficient tier is 128 bytes: 64 / 32 / 128 elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..capture.ops import GemmOp
from ..formats import Format

# Required multiple in elements per format (16 bytes / element size): NVIDIA "Matrix Multiplication
# Background" guide, Table 1 (cuBLAS >= 11: "always but most efficient with multiples of ...").
REQUIRED_MULTIPLE: dict[Format, int] = {Format.FP16: 8, Format.BF16: 8, Format.TF32: 4,
                                        Format.FP8_E4M3: 16, Format.FP8_E5M2: 16}
# The efficient tier on A100 and later (128 bytes): same table, "on A100, multiples of 64 / 32 / 128".
EFFICIENT_MULTIPLE: dict[Format, int] = {Format.FP16: 64, Format.BF16: 64, Format.TF32: 32,
                                         Format.FP8_E4M3: 128, Format.FP8_E5M2: 128}
# Output tile edge used for tile-quantization waste (typical cuBLAS tiles are 128 or 256 wide; docs/gpus.md).
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
    return GemmOp(g.op, g.kind, m, n, k, g.batch, flops, dims, g.note, lowered=g.lowered)


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


# --- ranking by cost (docs/report.md "Alignment") -----------------------------------------------------------

# A dimension is listed on its own only when padding it saves at least this much per training step on the
# target (cost model) AND this share of the estimated step; the rest are collapsed into one count. 0.1 µs is
# a tenth of a kernel launch, below anything a profiler resolves; 0.1% of the step keeps a ResNet stem
# convolution (3 input channels) listed and drops a classifier head with N = 2 labels (nanoseconds).
MIN_TIME_LOST_S = 1e-7
MIN_STEP_SHARE = 1e-3
# A matrix product's N or K below the multiple (a classifier head's N = num_labels = 2) is collapsed whatever
# the cost model says: such a GEMM is a few columns wide and bound by reading its input, which padding the
# columns does not change; the model's flat 2x misalignment penalty overstates it. (A convolution's 3 input
# channels stay: padding them to 4 or 8 is what the NVIDIA guide recommends for a stem.)
SKINNY_DIMS = ("N", "K")
# The format findings are ranked in: the first of these the audit estimated (their multiples are the strictest).
RANK_FORMATS = (Format.BF16, Format.FP16, Format.TF32)


def batch_set_dims(g: GemmOp) -> frozenset[str]:
    """Dimensions of ``g`` that the sample batch sets rather than the model: the rows M of a matrix product
    (batch x sequence for a linear layer, the sequence for a batched one), and N or K of a batched product
    equal to its M (the key length of self-attention). Convolutions, attention kernels and matrix-vector
    products have none among the dimensions they report."""
    if g.kind != "matmul" or g.op == "mv":
        return frozenset()
    out = {"M"}
    if g.batch > 1:
        out |= {d for d, _, s in g.dims if d in ("N", "K") and s == g.m}
    return frozenset(out)


def pad_only(g: GemmOp, fmt: Format, which: set[str] | frozenset[str]) -> GemmOp:
    """``g`` with only the dimensions named in ``which`` padded to ``fmt``'s multiple (M/N/K of a matmul;
    C_out -> N and E -> K of attention; a convolution's C_in as its GEMM K rounded up to the multiple, as
    :func:`padded` does, since an implicit-GEMM convolution never materialises K = C_in x kernel taps)."""
    req = REQUIRED_MULTIPLE[fmt]
    m, n, k = g.m, g.n, g.k
    dims = []
    for d, name, s in g.dims:
        new = round_up(s, req) if d in which and s > 1 else s
        if new != s:
            if d == "M":
                m = new
            elif d in ("N", "C_out"):
                n = new
            elif d in ("K", "E"):
                k = new
            elif d == "C_in":
                k = round_up(k, req)
        dims.append((d, name, new))
    flops = int(g.flops * (m * n * k) / max(1, g.m * g.n * g.k))
    return GemmOp(g.op, g.kind, m, n, k, g.batch, flops, tuple(dims), g.note, lowered=g.lowered)


def tied_modules(model) -> dict[str, list[str]]:
    """Module name -> the other modules holding one of its parameters as the same Parameter object (weight
    tying, e.g. GPT-2's ``lm_head.weight is transformer.wte.weight``). Modules sharing nothing are absent."""
    owners: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            if name not in owners.setdefault(id(p), []):
                owners[id(p)].append(name)
    out: dict[str, list[str]] = {}
    for names in owners.values():
        for n in names:
            for o in names:
                if o != n and o not in out.setdefault(n, []):
                    out[n].append(o)
    return {n: v for n, v in out.items() if v}


def _rank_format(layers: dict[str, list[dict[str, Any]]], step_time_s: dict[str, float]) -> str | None:
    """The first of :data:`RANK_FORMATS` that the records were estimated in (the audited formats, and TF32)."""
    present = {f for records in layers.values() for op in records or []
               for f in (op.get("estimated_time_lost_s") or {})}
    return next((f.value for f in RANK_FORMATS if f.value in present and step_time_s.get(f.value)), None)


def rank_alignment(layers: dict[str, list[dict[str, Any]]], step_time_s: dict[str, float], target_name: str,
                   batch: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """audit.json's ``alignment``: the per-layer alignment records (performance.py) ranked by estimated time
    lost per step, with the dimensions set by the sample batch gathered into one note and those too small to
    matter (under :data:`MIN_TIME_LOST_S` or :data:`MIN_STEP_SHARE` of the step) collapsed into a count.

    The same dimension (kind, size, suggested size) in several modules is one finding: its modules listed and
    its time summed. A GEMM with several misaligned model dimensions splits its time lost evenly among them.
    """
    fmt = _rank_format(layers, step_time_s)
    step = step_time_s.get(fmt) if fmt else None
    groups: dict[tuple, dict[str, Any]] = {}
    by_batch = _BatchDims()
    for name, records in layers.items():
        for op in records or []:
            dims = [d for d in op.get("dims") or [] if d.get("format") in (fmt, "any")]
            lost = (op.get("estimated_time_lost_s") or {}).get(fmt, 0.0) or 0.0
            model_bad = [d for d in dims if not d.get("set_by_batch") and d.get("aligned") is False]
            by_batch.add(name, op, [d for d in dims if d.get("set_by_batch") and d.get("aligned") is False], fmt)
            for d in dims:
                if not d.get("set_by_batch"):
                    _add_to_group(groups, name, op, d, lost / len(model_bad) if d in model_bad else 0.0)

    def matters(gr: dict[str, Any]) -> bool:
        lost = gr["estimated_time_lost_s"]
        skinny = (gr["kind"] == "matmul" and gr["dim"] in SKINNY_DIMS
                  and gr["size"] < (gr.get("required_multiple") or 0))
        return not skinny and lost >= MIN_TIME_LOST_S and (not step or lost / step >= MIN_STEP_SHARE)

    listed: list[Any] = []
    small: list[Any] = []
    for gr in groups.values():
        gr["step_share"] = gr["estimated_time_lost_s"] / step if step else None
        (listed if matters(gr) else small).append(gr)
    listed.sort(key=lambda g: (-g["estimated_time_lost_s"], g["modules"][0], g["dim"]))
    for i, gr in enumerate(listed, 1):
        gr["rank"] = i
        gr["text"] = _finding_text(gr, fmt)
    return {
        "ranked_by": (f"estimated time lost per training step on {target_name} in {fmt} (cost model: an estimate; "
                      "a misaligned GEMM is taken as 2x slower, a heuristic)") if fmt else None,
        "format": fmt, "step_time_s": step,
        "threshold": {"min_time_lost_s": MIN_TIME_LOST_S, "min_step_share": MIN_STEP_SHARE},
        "findings": listed, "batch_note": by_batch.note(step, batch), "collapsed": _collapsed(small, target_name),
    }


def _add_to_group(groups: dict[tuple, dict[str, Any]], name: str, op: dict[str, Any], d: dict[str, Any],
                  share_of_op: float) -> None:
    """Count one model dimension of one GEMM record into its finding (kind, dimension, size, suggested size)."""
    key = (op.get("kind"), d["dim"], d["size"], d.get("suggested_size"))
    gr = groups.get(key)
    if gr is None:
        gr = groups[key] = {
            "dim": d["dim"], "name": d.get("name"), "size": d["size"],
            "suggested_size": d.get("suggested_size"), "efficient_size": d.get("efficient_size"),
            "required_multiple": d.get("required_multiple"),
            "aligned": d.get("aligned"), "kind": op.get("kind"), "op": op.get("op"),
            "gemm": op.get("gemm"), "modules": [], "ops": 0, "calls": 0,
            "estimated_time_lost_s": 0.0, "advice": op.get("vocabulary_advice"),
            "tied_to": [], "measured": op.get("measured"), "cost": d.get("cost"),
        }
    if name not in gr["modules"]:
        gr["modules"].append(name)
    gr["ops"] += 1
    gr["calls"] += op.get("calls") or 0
    gr["estimated_time_lost_s"] += share_of_op
    gr["advice"] = gr["advice"] or op.get("vocabulary_advice")
    gr["measured"] = gr["measured"] or op.get("measured")
    for t in (op.get("tied_to") or []) if d["dim"] == "N" else []:  # a tied head's vocabulary
        if t not in gr["tied_to"]:
            gr["tied_to"].append(t)


def _collapsed(small: list[dict[str, Any]], target_name: str) -> dict[str, Any]:
    """The findings too small to list, as one count."""
    collapsed_lost = sum(g["estimated_time_lost_s"] for g in small)
    n_mis = sum(1 for g in small if g["aligned"] is False)
    return {
        "count": len(small), "misaligned": n_mis, "below_efficient_tier": len(small) - n_mis,
        "modules": len({m for g in small for m in g["modules"]}),
        "estimated_time_lost_s": collapsed_lost,
        "text": (f"{len(small)} more dimension(s) ({n_mis} misaligned, {len(small) - n_mis} only below the "
                 f"efficient tier) each cost under {MIN_TIME_LOST_S * 1e6:g} µs or {MIN_STEP_SHARE:.1%} of the step"
                 f" on {target_name}: {collapsed_lost * 1e6:.3g} µs per step together"
                 + (f" (e.g. {_examples(small)})" if small else "")) if small else None,
    }


class _BatchDims:
    """The misaligned dimensions set by the sample batch (rows, sequence length), gathered into one note."""

    def __init__(self) -> None:
        self.sizes: dict[int, dict[str, Any]] = {}
        self.ops = 0
        self.modules: set[str] = set()
        self.lost = 0.0

    def add(self, name: str, op: dict[str, Any], batch_bad: list[dict[str, Any]], fmt: str | None) -> None:
        if not batch_bad:
            return
        self.ops += 1
        self.modules.add(name)
        self.lost += (op.get("estimated_batch_time_lost_s") or {}).get(fmt, 0.0) or 0.0
        for d in batch_bad:
            e = self.sizes.setdefault(d["size"], {"size": d["size"], "suggested_size": d["suggested_size"],
                                                  "efficient_size": d.get("efficient_size"),
                                                  "dims": [], "gemms": 0})
            e["gemms"] += 1
            if d["dim"] not in e["dims"]:
                e["dims"].append(d["dim"])

    def note(self, step: float | None, batch: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        if not self.sizes:
            return None
        sizes = sorted(self.sizes.values(), key=lambda e: -e["gemms"])
        shapes = ", ".join(f"{b['name']} {b['shape']}" for b in (batch or []) if b.get("shape"))
        pads = ", ".join(f"{e['size']} -> {e['suggested_size']}"
                         + (f" ({e['efficient_size']} on the efficient tier)" if e.get("efficient_size") else "")
                         for e in sizes)
        return {
            "sizes": sizes, "gemms": self.ops, "modules": len(self.modules),
            "estimated_time_lost_s": self.lost, "step_share": self.lost / step if step else None,
            "text": (f"{self.ops} GEMM(s) in {len(self.modules)} module(s) have rows (batch x sequence) or a "
                     f"sequence length off the multiple: {', '.join(str(e['size']) for e in sizes)}. These are set by "
                     f"the sample batch{f' ({shapes})' if shapes else ''}, not by the model: choose a training batch "
                     f"size and sequence length whose product is a multiple of 8 (64 on A100 and later): {pads}; "
                     f"est. {self.lost * 1e6:.3g} µs per step at this batch"),
        }


def _examples(small: list[dict[str, Any]], n: int = 3) -> str:
    top = sorted(small, key=lambda g: -g["estimated_time_lost_s"])[:n]
    return "; ".join(f"{g['dim']}={g['size']} in {g['modules'][0]}"
                     + (f" and {len(g['modules']) - 1} more" if len(g["modules"]) > 1 else "") for g in top)


def _finding_text(gr: dict[str, Any], fmt: str | None) -> str:
    where = gr["modules"][0] + (f" and {len(gr['modules']) - 1} more module(s)" if len(gr["modules"]) > 1 else "")
    lost = gr["estimated_time_lost_s"]
    share = f" ({gr['step_share']:.1%} of the step)" if gr.get("step_share") is not None else ""
    pad = (f"pad {gr['size']} -> {gr['suggested_size']}" if gr["aligned"] is False
           else f"{gr['size']} is aligned but below the efficient tier")
    if gr.get("efficient_size") and gr["efficient_size"] != gr["suggested_size"]:
        pad += f" ({gr['efficient_size']} on the efficient tier)"
    text = (f"{gr['dim']} = {gr['size']} ({gr['name']}) in {where}: {pad}; "
            f"est. {lost * 1e6:.3g} µs per step{share} in {fmt}")
    if gr.get("tied_to"):
        text += (f"; its weight is the same Parameter as {', '.join(repr(t) for t in gr['tied_to'])} (tied): "
                 "pad that embedding's vocabulary and this dimension follows")
    if gr.get("advice"):
        text += f"; {gr['advice']}"
    return text
