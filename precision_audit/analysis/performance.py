"""Alignment, cost and memory findings: how fast each format would be on the target, and what it holds.

Estimates come from the cost model (cost.py) and are labelled as estimates; measured figures come from the
capture's timed steps and saved-tensor counts and are labelled with where they were measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..capture.records import CaptureResult, LayerRecord
from ..formats import AUTOCAST_FORMATS, Format
from ..gpus import GpuSpec
from ..record import FormatMemory, Memory
from .alignment import REQUIRED_MULTIPLE, batch_set_dims, check_dims, padded, vocabulary_advice
from .cost import (
    ASSUMPTIONS,
    ELEMENT_BYTES,
    STEP_OVER_FORWARD,
    alignment_time_lost,
    gemm_time,
    layer_cost,
    step_kernels,
)
from .cost import floor as kernel_floor

# Formats the cost model estimates when the target supports them (TF32 needs no numerics run to be timed).
ESTIMATED_FORMATS = AUTOCAST_FORMATS
VOCAB_MIN = 1000  # an output dimension this large on an embedding or LM head is a vocabulary


@dataclass
class LayerCostEstimate:
    """A module's own computation and its estimated step time per format on the target (cost.py's roofline)."""

    flops: int
    gemm_ops: int
    other_ops: int
    other_elements: int
    estimated_step_time_s: dict[str, float]  # by format name
    #: The largest distinct GEMMs timed on the GPU (cuda mode; analysis/gemm_timing.py), one record per GEMM.
    measured_gemms: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class LayerPerformance:
    #: One finding per GEMM, convolution or embedding of its own that is not aligned (analysis/alignment.py
    #: ranks them and the GPU timing adds ``measured``; they keep the shape audit.json's ``layers[].alignment``
    #: gives them).
    alignment: list[dict[str, Any]]
    cost: LayerCostEstimate | None
    saved_bytes: dict[str, int]
    measured_time_s: dict[str, float]


@dataclass
class Performance:
    layers: dict[str, LayerPerformance]
    step_time_s: dict[str, float]  # estimated, per format
    speedup_vs_fp32: dict[str, float | None]
    formats: tuple[Format, ...]
    memory: Memory
    assumptions: tuple[str, ...] = ASSUMPTIONS
    notes: list[str] = field(default_factory=list)
    #: kernels one training step runs (the ops executed, backward estimated; analysis/cost.py step_kernels)
    kernels: int = 0
    #: kernels x the per-kernel floor: no format's estimated step is below it (analysis/cost.py)
    floor_s: float = 0.0
    #: per format, the ops outside every module (the loss): in ``step_time_s``, in no layer's cost
    outside_step_time_s: dict[str, float] = field(default_factory=dict)


def _element_bytes(rec: LayerRecord, fmt: Format) -> int:
    """Element size of a module's elementwise traffic in ``fmt``: what its outputs were in that run."""
    if fmt in (Format.FP32, Format.TF32):
        return 4
    fs = rec.formats.get(fmt)
    if fs is None or not fs.output_dtypes:
        return ELEMENT_BYTES[fmt]
    return 4 if "float32" in fs.output_dtypes else ELEMENT_BYTES[fmt]


def _gemm_findings(rec: LayerRecord, target: GpuSpec, formats: tuple[Format, ...],
                   tied_to: list[str] | None = None) -> list[dict[str, Any]]:
    efficient_tier = target.compute_capability >= (8, 0)
    low = [f for f in formats if f in REQUIRED_MULTIPLE]
    out = []
    for g, calls in rec.ops.gemms.values():
        if not g.lowered:  # runs in FP32 under autocast: no fp16/bf16 alignment to meet (its note says so)
            continue
        by_batch = batch_set_dims(g)
        dims_out: list[dict[str, Any]] = []
        for fmt in low:
            for d in check_dims(g, fmt, efficient_tier):
                if d.aligned and d.efficient:
                    continue
                dims_out.append({
                    "format": fmt.value, "dim": d.dim, "name": d.name, "size": d.size,
                    "required_multiple": d.required_multiple, "suggested_size": d.suggested_size,
                    "efficient_multiple": d.efficient_multiple, "efficient_size": d.efficient_size,
                    "aligned": d.aligned, "tile_waste_pct": d.tile_waste_pct,
                    "set_by_batch": d.dim in by_batch,
                    "cost": ("misaligned: slower kernels (cost, not eligibility)" if not d.aligned
                             else f"aligned to {d.required_multiple} but not to {d.efficient_multiple}: "
                                  "below the most efficient tier"),
                })
        if not dims_out:
            continue
        time_s, padded_s, lost_model, lost_batch = {}, {}, {}, {}
        # the roofline's GEMM time without the per-kernel floor: what padding saves in GPU work; a kernel at the
        # floor saves nothing until its launches are amortised (docs/report.md, "Alignment")
        for fmt in low:
            time_s[fmt.value] = gemm_time(g, fmt, target) * calls * STEP_OVER_FORWARD
            padded_s[fmt.value] = gemm_time(padded(g, fmt), fmt, target) * calls * STEP_OVER_FORWARD
            lb, lm = alignment_time_lost(g, fmt, target, by_batch)
            lost_batch[fmt.value] = lb * calls * STEP_OVER_FORWARD
            lost_model[fmt.value] = lm * calls * STEP_OVER_FORWARD
        finding: dict[str, Any] = {
            "op": g.op, "kind": g.kind, "gemm": {"m": g.m, "n": g.n, "k": g.k, "batch": g.batch},
            "calls": calls, "flops": g.flops * calls, "dims": dims_out,
            "estimated_step_time_s": time_s, "estimated_padded_step_time_s": padded_s,
            "estimated_saving_s": {k: max(0.0, time_s[k] - padded_s[k]) for k in time_s},
            # the saving split: the model's own dimensions (ranked in audit.json's alignment) and those set by
            # the sample batch (one batch-size note); analysis/alignment.py
            "estimated_time_lost_s": lost_model, "estimated_batch_time_lost_s": lost_batch,
            "note": g.note,
        }
        if tied_to:
            finding["tied_to"] = list(tied_to)
        big_out = [d for d in dims_out if d["dim"] == "N" and d["size"] >= VOCAB_MIN]
        if big_out and (rec.type == "Linear" and ("head" in rec.name or "lm" in rec.name or "vocab" in rec.name
                                                  or big_out[0]["size"] >= 30000)):
            finding["vocabulary_advice"] = vocabulary_advice(big_out[0]["size"])
        out.append(finding)
    return out


def _embedding_findings(rec: LayerRecord, module_shapes: dict[str, list[int]], target: GpuSpec,
                        tied_to: list[str] | None = None) -> list[dict[str, Any]]:
    shape = module_shapes.get(rec.name)
    if rec.type != "Embedding" or not shape or shape[0] < VOCAB_MIN or shape[0] % 64 == 0:
        return []
    heads = [t for t in tied_to or [] if t not in module_shapes]  # sharers that are not embeddings themselves
    cost = (f"the embedding itself is a gather; its weight is the same Parameter as "
            f"{', '.join(repr(t) for t in heads)} (a tied LM head), whose GEMM has this vocabulary as N" if heads else
            "the embedding itself is a gather (no Tensor Core work) and no LM head shares its weight (untied): "
            "its size costs no GEMM time here")
    return [{"op": "embedding", "kind": "embedding", "gemm": None, "calls": rec.calls, "flops": 0,
             "dims": [{"format": "any", "dim": "V", "name": "vocabulary (num_embeddings)", "size": shape[0],
                       "required_multiple": 8, "suggested_size": -(-shape[0] // 8) * 8, "efficient_multiple": 64,
                       "efficient_size": -(-shape[0] // 64) * 64, "aligned": shape[0] % 8 == 0,
                       "tile_waste_pct": None, "set_by_batch": False, "cost": cost}],
             "estimated_step_time_s": None, "estimated_padded_step_time_s": None, "estimated_saving_s": None,
             "note": None, "vocabulary_advice": vocabulary_advice(shape[0]),
             **({"tied_to": list(tied_to)} if tied_to else {})}]


def performance(capture: CaptureResult, target: GpuSpec, module_shapes: dict[str, list[int]],
                param_bytes: int, trainable_params: int, tied: dict[str, list[str]] | None = None) -> Performance:
    """Alignment findings, per-layer and per-format cost estimates, and memory, from a finished capture."""
    est_formats = tuple(f for f in ESTIMATED_FORMATS if target.supports(f.value))
    layers: dict[str, LayerPerformance] = {}
    totals = {f.value: 0.0 for f in est_formats}
    kernels = 0
    for rec in capture.layers:
        tied_to = (tied or {}).get(rec.name)
        alignment = _gemm_findings(rec, target, capture.formats + ((Format.TF32,) if target.supports("tf32") else ()),
                                   tied_to)
        alignment += _embedding_findings(rec, module_shapes, target, tied_to)
        cost = None
        if rec.ops.gemms or rec.ops.other_ops:  # every op runs a kernel, even one with no float elements
            per_fmt = {}
            for f in est_formats:
                lc = layer_cost(rec.ops, f, target, _element_bytes(rec, f))
                per_fmt[f.value] = lc.step_time_s
                totals[f.value] += lc.step_time_s
            kernels += step_kernels(rec.ops)
            cost = LayerCostEstimate(flops=rec.ops.gemm_flops, gemm_ops=sum(c for _, c in rec.ops.gemms.values()),
                                     other_ops=rec.ops.other_ops, other_elements=rec.ops.other_elements,
                                     estimated_step_time_s=per_fmt)
        layers[rec.name] = LayerPerformance(alignment, cost, dict(rec.saved_bytes), dict(rec.measured_time_s))
    outside = capture.outside_ops  # the loss: part of the step, in no module's record
    loss_s = {f.value: layer_cost(outside, f, target, 4).step_time_s for f in est_formats} \
        if outside.gemms or outside.other_ops else {}
    for k, v in loss_s.items():
        totals[k] += v
    kernels += step_kernels(outside)
    base = totals.get("fp32") or 0.0
    speedup = {k: (base / v if v > 0 else None) for k, v in totals.items()}
    memory = _memory(capture, param_bytes, trainable_params)
    floor = kernels * kernel_floor()
    assumptions: tuple[str, ...] = ASSUMPTIONS
    if totals and kernels:  # the floor's share says how launch-bound the estimate is (docs/report.md)
        fastest = min(totals.values())
        assumptions += (f"this model: {kernels:,} kernels per step, so no step is estimated below "
                        f"{floor * 1e6:.4g} µs ({floor / fastest:.0%} of the fastest format's estimate)",)
    if loss_s:  # in the step, in no layer's cost (audit.json's layers add up to the step less this)
        assumptions += ("the ops outside the model's modules (the loss): "
                        + ", ".join(f"{k} {v * 1e6:.6g} µs" for k, v in loss_s.items()) + " of each step",)
    return Performance(layers=layers, step_time_s=totals, speedup_vs_fp32=speedup, formats=est_formats,
                       memory=memory, assumptions=assumptions, kernels=kernels, floor_s=floor,
                       outside_step_time_s=loss_s)


PEAK_BASIS = ("peak GPU allocation of one clean (uninstrumented) forward+backward step above what was allocated "
              "when the step started: activations, gradients and temporaries; the parameters, the batch and "
              "what the audit itself keeps are in the baseline, not in the figure (no optimizer state)")


def _peak_note(capture: CaptureResult, m: dict[str, Any]) -> str | None:
    if m.get("peak_bytes") is not None:
        return None
    if capture.mode != "cuda":
        return "not measured: no GPU in this run"
    return "not measured: no clean timed step ran for this format (--steps 0, or its pass failed)"


def _memory(capture: CaptureResult, param_bytes: int, trainable_params: int) -> Memory:
    grads = trainable_params * 4  # fp32 master gradients under autocast
    per_run: dict[str, FormatMemory] = {}
    for key, m in capture.memory.items():
        act = m.get("activation_bytes", 0)
        wc = m.get("weight_copy_bytes", 0)
        per_run[key] = FormatMemory(
            parameters_bytes=param_bytes,
            gradients_bytes=grads,
            optimizer_bytes={"adam": trainable_params * 8, "sgd_momentum": trainable_params * 4, "sgd": 0},
            saved_activation_bytes=act,
            saved_weight_copy_bytes=wc,
            total_with_adam_bytes=param_bytes + grads + trainable_params * 8 + act + wc,
            peak_gpu_bytes=m.get("peak_bytes"),
            peak_note=_peak_note(capture, m),
        )
    advice = []
    ref = per_run["fp32"].saved_activation_bytes if "fp32" in per_run else None
    for key, r in per_run.items():
        if key == "fp32" or not ref:
            continue
        act = r.saved_activation_bytes
        if act < ref:
            advice.append(f"{key} saves {(ref - act) / 2**20:.2f} MiB of activations ({1 - act / ref:.0%} of FP32's "
                          f"{ref / 2**20:.2f} MiB): about {ref / max(act, 1):.2f}x the batch fits in the same "
                          "activation memory")
    heavy = sorted(((rec.saved_bytes.get("fp32", 0), rec.name) for rec in capture.layers
                    if rec.name and rec.is_leaf), reverse=True)[:3]
    if heavy and ref:
        names = ", ".join(f"{n} ({b / 2**20:.2f} MiB)" for b, n in heavy if b)
        if names:
            advice.append(f"the layers saving the most for backward (candidates for activation checkpointing): {names}")
    return Memory(per_format=per_run, advice=advice,
                  note="activations: tensors autograd saved for backward in each pass, counted once per storage "
                       "(parameters excluded; autocast's casts of parameters, and views of them such as the "
                       "transposed weight a GEMM saves, are weight copies in both modes; in emulated mode fp16/bf16 "
                       "values held in fp32 are counted at 2 bytes)",
                  peak_basis=PEAK_BASIS if capture.mode == "cuda" else None)
