"""The audit's typed record (precision_audit/record/__init__.py) and its one converter (record/codec.py), and the
planning, policy and record-building steps on hand-made findings (issue 13, items 1 and 2; docs/record.md).

The stored audit.json of every sample model (tests/golden/) is the reference for the round trip: read into the
record and written back it must be the same document, so the converter neither loses nor
invents a field; what it writes it reads back to the same text. The planning tests build an :class:`Analysis` by
hand, with a known answer, and call the planner and the policy builder without running a model.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from models import tiny_mlp
from precision_audit import record as R
from precision_audit.analysis.findings import (
    Analysis,
    Budget,
    FormatError,
    FormatSummary,
    GradientFinding,
    LayerFinding,
    RangeFinding,
)
from precision_audit.assemble import layer_report, plan_counts, verdict
from precision_audit.capture.stats import ErrorStats
from precision_audit.formats import Format
from precision_audit.gpus import resolve_target
from precision_audit.planning.build_policy import DEFAULT_INIT_SCALE, build_policy
from precision_audit.planning.rules import LayerPlan, Plan, plan_by_rules
from precision_audit.record import fp8 as F8
from precision_audit.record.codec import ReportInputError, from_json, read, to_json

GOLDEN = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists()) / "tests" / "golden"
SAMPLES = sorted(p.name.removesuffix(".audit.json") for p in GOLDEN.glob("*.audit.json"))


def _stored(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.audit.json").read_text())


# --- the round trip -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SAMPLES)
def test_stored_audit_reads_into_the_record_and_writes_back_the_same(name):
    doc = _stored(name)
    record = from_json(copy.deepcopy(doc))
    assert isinstance(record, R.AuditRecord)
    again = to_json(record)
    assert again == doc
    # written, read and written again: the same text, key order included (the stored files are key-sorted)
    assert json.dumps(to_json(from_json(again)), indent=1) == json.dumps(again, indent=1)
    # nothing of a file the audit wrote is left to the catch-all
    assert not record.extra and not record.absent - {"verify", "fp8", "distributed"}
    assert all(not L.extra for L in record.layers)


@pytest.mark.parametrize("name", SAMPLES)
def test_the_record_is_typed_all_the_way_to_the_figures(name):
    doc = _stored(name)
    r = from_json(doc)
    assert r.model.class_ == doc["model"]["class"]
    for f in r.formats:
        s = r.summary.formats[f]
        assert isinstance(s, R.FormatSummary) and isinstance(s.step_time, R.StepTime)
        assert s.loss_rel_change == doc["summary"][f]["loss_rel_change"]
        assert s.output is None or isinstance(s.output, R.ErrorMetrics)
    for L, raw in zip(r.layers, doc["layers"]):
        assert isinstance(L, R.LayerReport) and L.name == raw["name"]
        assert isinstance(L.plan, R.ModulePlan) and L.plan.format == raw["plan"]["format"]
        assert isinstance(L.activation, R.Activation) and isinstance(L.gradient.output, R.OutputGradient)
        assert L.cost is None or isinstance(L.cost, R.LayerCost)
        for f, e in L.error.items():
            assert isinstance(e, R.LayerError)
            assert (e.local is None) == (raw["error"][f]["local"] is None)
    assert isinstance(r.plan.verification, R.PlanVerification)
    assert all(isinstance(c, R.PlanCandidateReport) for c in r.plan.candidates)
    assert sum(c.chosen for c in r.plan.candidates) == 1
    assert r.memory is not None and isinstance(r.memory.per_format["fp32"], R.FormatMemory)
    assert r.layer("") is r.layers[0] if r.layers[0].name == "" else r.layer("") is None


def test_a_hand_edited_file_keeps_unknown_keys_and_leaves_out_what_it_lacked():
    doc = _stored("mlp")
    doc["comment"] = "checked by hand"
    doc["layers"][1]["reviewed"] = True
    del doc["estimates"]
    del doc["memory"]
    r = from_json(copy.deepcopy(doc))
    assert r.estimates is None and r.memory is None and {"estimates", "memory"} <= r.absent
    assert r.extra == {"comment": "checked by hand"} and r.layers[1].extra == {"reviewed": True}
    assert to_json(r) == doc  # no "estimates": null, no lost key
    # the speedup falls back on the summary's own estimates when "estimates" is gone
    est = doc["summary"]["fp32"]["step_time"]["estimated_s"] / doc["summary"]["fp16"]["step_time"]["estimated_s"]
    assert r.estimated_speedup("fp16") == pytest.approx(est, rel=1e-12)


def test_from_json_validates_and_names_the_field():
    doc = _stored("mlp")
    doc["layers"][2]["calls"] = "three"
    with pytest.raises(ReportInputError, match=r"layers\[2\]\.calls"):
        from_json(doc)
    with pytest.raises(ReportInputError, match="not an audit.json"):
        from_json({"schema": "precision-audit/policy"})


def test_non_finite_figures_are_written_as_null():
    m = R.ErrorMetrics(rel_l2=math.inf, sqnr_db=None, max_abs=math.nan, cosine=0.5, nonfinite=3, elements=8,
                       exact=False, fp32_nonfinite=0)
    assert to_json(m) == {"rel_l2": None, "sqnr_db": None, "max_abs": None, "cosine": 0.5, "nonfinite": 3,
                          "elements": 8, "exact": False, "fp32_nonfinite": 0}


def test_verification_is_a_typed_field_of_the_record_and_passes_the_schema():
    r = from_json(_stored("fp16_trouble"))
    assert "verify" not in to_json(r)
    r.verify = R.VerifyResult(steps=2, optimizer="adam", lr=1e-3, seed=0, mode="emulated",
                              curves={"fp32": [1.0, 0.9], "policy": [1.0, 0.91], "bf16": [1.0, 0.95],
                                      "fp16": [None, None]},
                              skipped_steps={"fp16": 2}, errors={}, final_loss_rel_change={"policy": 0.0111},
                              param_rel_change={"policy": 0.001}, policy_failure=None, policy_safe=True,
                              loss=R.LossFacts(kind="loss_fn", description="loss_fn(output, batch)"))
    doc = to_json(r)
    assert doc["verify"]["curves"]["fp16"] == [None, None] and doc["verify"]["loss"]["kind"] == "loss_fn"
    back = from_json(doc)  # validates against precision_audit/record/schemas/audit.schema.json
    assert back.verify == r.verify


def test_read_keeps_a_value_of_another_shape_than_the_field():
    """A schema-valid file may hold a shape this version does not type (the report renders it generically)."""
    layer = copy.deepcopy(_stored("mlp")["layers"][1])
    layer["alignment"] = {"findings": []}
    L = read(R.LayerReport, layer)
    assert L.alignment == {"findings": []} and to_json(L) == layer


# --- hand-made findings: planning, policy, record sections --------------------------------------------------


def _range(amax: float, overflow16: float = 0.0) -> RangeFinding:
    fr = {"fp16": {"flushed": 0.0, "subnormal": 0.0, "overflow": overflow16},
          "bf16": {"flushed": 0.0, "subnormal": 0.0, "overflow": 0.0}}
    return RangeFinding(amax=amax, elements=64, zeros=0, nonfinite=0, headroom_bits={"fp16": 1.0, "bf16": 100.0},
                        fractions=fr, exponent_histogram={-1: 60, 3: 4})


def _stats(rel: float) -> ErrorStats:
    # rel_l2 = sqrt(sum_diff2 / sum_ref2)
    return ErrorStats(n=64, sum_ref2=1.0, sum_diff2=rel * rel, sum_dot=1.0, sum_p2=1.0, max_abs=rel)


def _layer(name: str, rel: float, amax: float = 1.0, overflow16: float = 0.0, computes: bool = True,
           leaf: bool = True) -> LayerFinding:
    grad = GradientFinding(output_amax=0.1, output_fp16_unscaled={"flushed": 0.0, "subnormal": 0.0, "overflow": 0.0},
                           output_fp16_at_recommended=None, param_amax=None, param_fp16_unscaled=None,
                           param_fp16_at_recommended=None, output_exponent_histogram={-4: 64},
                           nonfinite={"fp16": 0})
    err = FormatError(local=_stats(rel), local_note=None, accumulated=_stats(rel), output_dtypes=["float16"],
                      activation_amax=amax, activation_nonfinite=0, unmatched_calls=0)
    return LayerFinding(name=name, type="Linear" if leaf else "Sequential", depth=name.count(".") + (1 if name else 0),
                        is_leaf=leaf, computes=computes, calls=1, param_count=10, total_param_count=10,
                        output_shapes=[[4, 4]], errors={Format.FP16: err}, activation=_range(amax, overflow16),
                        gradient=grad)


def _analysis(layers: list[LayerFinding]) -> Analysis:
    s = FormatSummary(format=Format.FP16, loss=2.0, loss_rel_change=1e-4, output=_stats(1e-3), output_nonfinite=0,
                      param_grads_nonfinite=0, loss_scale=1024.0, error=None, safe=True, verdict="safe")
    return Analysis(layers=layers, summaries={Format.FP16: s}, loss_scale=None, budget=Budget(), reference_loss=2.0)


def test_rules_plan_pins_an_overflowing_layer_and_an_error_outlier_to_fp32():
    """V100-like target (fp16 only): 'big' overflows fp16, 'noisy' has 100x the median local error; the rest
    keep the default. The known answer: exactly those two pinned, with reasons quoting the figures."""
    layers = [_layer("", 1e-3, computes=False, leaf=False), _layer("a", 1e-3), _layer("b", 2e-3),
              _layer("big", 1e-3, amax=1e5, overflow16=0.25), _layer("noisy", 0.1), _layer("c", 1e-3)]
    plan = plan_by_rules(_analysis(layers), (Format.FP16,), "V100")
    assert plan.default_format is Format.FP16
    assert set(plan.overrides) == {"big", "noisy"}
    big = plan.overrides["big"]
    assert big.format is Format.FP32 and "25.0% of its values overflow" in big.reason
    assert "local error 1.00e-01" in plan.overrides["noisy"].reason
    assert {n: lp.format for n, lp in plan.layers.items() if n not in plan.overrides} == \
        {"": Format.FP16, "a": Format.FP16, "b": Format.FP16, "c": Format.FP16}
    assert plan_counts(plan) == "2 in fp32"


def test_rules_plan_pins_the_smallest_responsible_module_only():
    layers = [_layer("", 1e-3, computes=False, leaf=False), _layer("block", 1e-3, amax=1e5, overflow16=0.5, leaf=False),
              _layer("block.inner", 1e-3, amax=1e5, overflow16=0.5), _layer("other", 1e-3)]
    plan = plan_by_rules(_analysis(layers), (Format.FP16,), "V100")
    assert set(plan.overrides) == {"block.inner"}


def test_rules_plan_without_a_low_precision_format_keeps_fp32():
    plan = plan_by_rules(_analysis([_layer("a", 1e-3)]), (), "T4")
    assert plan.default_format is Format.FP32 and not plan.overrides and plan.layers["a"].format is Format.FP32


def _model():
    import torch

    torch.manual_seed(0)
    return tiny_mlp(4, 4, 2)


def test_policy_of_a_plan_turns_loss_scaling_on_only_with_fp16_and_tf32_off_after_an_error_pin():
    from precision_audit.model_names import fingerprint

    model, target = _model(), resolve_target("h100")
    fp, n = fingerprint(model)
    bf16 = Plan(default_format=Format.BF16, default_reason="test")
    p = build_policy(model, fp, n, target, bf16, None)
    # TF32 not measured: off (tests/capture/test_tf32.py has the measured cases)
    assert not p.loss_scaling.enabled and not p.tf32_matmul and p.default_format == "bf16"
    mixed = Plan(default_format=Format.BF16, default_reason="test",
                 overrides={"0": LayerPlan(Format.FP16, "fastest"),
                            "2": LayerPlan(Format.FP32, "fp16 local error 1e-1")})
    tf32 = FormatSummary(Format.TF32, 1.0, 1e-4, None, 0, 0, 1.0, None, True, "safe as is")
    assert build_policy(model, fp, n, target, bf16, None, tf32).tf32_matmul
    p = build_policy(model, fp, n, target, mixed, 2.0 ** 12, tf32)
    assert p.loss_scaling.enabled and p.loss_scaling.init_scale == 2.0 ** 12
    assert not p.tf32_matmul and not p.tf32_cudnn  # TF32 would undo a pin for local error
    assert {k: v.format for k, v in p.modules.items()} == {"0": "fp16", "2": "fp32"}
    fp16 = build_policy(model, fp, n, target, Plan(Format.FP16, "t"), None)
    assert fp16.loss_scaling.init_scale == DEFAULT_INIT_SCALE
    v100 = build_policy(model, fp, n, resolve_target("v100"), bf16, None)
    assert not v100.tf32_matmul  # no TF32 before Ampere


def test_verdict_and_layer_entry_from_hand_made_findings():
    layers = [_layer("", 1e-3, computes=False, leaf=False), _layer("a", 1e-3)]
    a = _analysis(layers)
    plan = plan_by_rules(a, (Format.FP16,), "V100")
    v = verdict(a, plan, (Format.FP16,))
    assert v.exit_code == 0 and v.safe_formats == ["fp16"] and v.message.startswith("recommended: fp16")
    unsafe = _analysis(layers)
    unsafe.summaries[Format.FP16] = FormatSummary(**{**vars(a.summaries[Format.FP16]), "safe": False})
    assert verdict(unsafe, plan, (Format.FP16,)).exit_code == 1
    assert verdict(a, plan, ()).message == "no low-precision format was audited"
    entry = layer_report(layers[1], plan, None, "here")
    assert entry.plan == R.ModulePlan(format="fp16", reason="default format")
    assert entry.alignment is None and entry.alignment_note == "not measured" and entry.cost is None
    assert entry.error["fp16"].local.rel_l2 == pytest.approx(1e-3)
    assert entry.activation.exponent_histogram == {"-1": 60, "3": 4}
    doc = to_json(entry)
    assert read(R.LayerReport, doc) == entry


# The ``distributed`` section as distributed/run.py wrote it while it was a dict (hand-written: the key order and
# values a 2-rank DDP audit of the mlp sample writes), the reference the typed section must write byte for byte.
_DISTRIBUTED_DICT = {
    "world_size": 2, "backend": "gloo", "parallelism": "DistributedDataParallel around the model",
    "batch": "the batch's first dimension split evenly: rows 0..3 on each rank", "global_batch_size": 8,
    "rank0_batch_size": 4, "reduced": "per-layer statistics summed over ranks",
    "memory": {"model_parameter_bytes": 1024, "materialised": "as built",
               "ranks": [{"rank": r, "parameter_bytes_held": 1024, "rss_start_bytes": 100 + r,
                          "rss_peak_after_init_bytes": 200 + r, "rss_peak_bytes": 300 + r} for r in (0, 1)],
               "note": "resident memory of each rank's process"},
}


def _typed_distributed(global_batch_size: int | None = 8) -> R.Distributed:
    d = R.Distributed(world_size=2, backend="gloo", parallelism="DistributedDataParallel around the model",
                      batch="the batch's first dimension split evenly: rows 0..3 on each rank",
                      global_batch_size=global_batch_size, rank0_batch_size=4,
                      reduced="per-layer statistics summed over ranks")
    d.memory = R.DistributedMemory(
        model_parameter_bytes=1024, materialised="as built",
        ranks=[R.RankMemory(rank=r, parameter_bytes_held=1024, rss_start_bytes=100 + r,
                            rss_peak_after_init_bytes=200 + r, rss_peak_bytes=300 + r) for r in (0, 1)],
        note="resident memory of each rank's process")
    return d


def test_the_typed_distributed_section_writes_the_dicts_bytes():
    assert json.dumps(to_json(_typed_distributed()), indent=2) == json.dumps(_DISTRIBUTED_DICT, indent=2)
    # sample_batch(rank, world_size) gave each rank its share: the global size is written as null, not left out
    assert to_json(_typed_distributed(None))["global_batch_size"] is None


def test_a_saved_distributed_section_reads_typed_and_writes_back_unchanged():
    back = read(R.Distributed, copy.deepcopy(_DISTRIBUTED_DICT))
    assert back.memory is not None and back.memory.ranks[1].rss_peak_bytes == 301
    assert json.dumps(to_json(back)) == json.dumps(_DISTRIBUTED_DICT)
    older = {k: v for k, v in _DISTRIBUTED_DICT.items() if k != "memory"}  # a section without per-rank memory
    assert to_json(read(R.Distributed, older)) == older


# The ``fp8`` section as fp8/measure.py ``result_dict``, fp8/plan.py ``to_dict`` and fp8/audit.py wrote it while it
# was a dict (hand-written: the key order of that code, for a 1-layer model with a matmul outside nn.Linear,
# two recipes, one of them failing the model, on an H100), the reference the typed section must write byte for byte.
_M = {"rel_l2": 0.0375, "sqnr_db": 28.5, "max_abs": 0.027, "cosine": 0.9993, "nonfinite": 0, "elements": 4096}
_M_INF = {"rel_l2": None, "sqnr_db": None, "max_abs": None, "cosine": None, "nonfinite": 3, "elements": 4096}
_OP = {"saturated_share": 0.0, "flushed_share": 0.25, "saturated": 0, "flushed": 1024, "nonzero": 4096,
       "nonfinite": 0, "scale_min": 123.5, "scale_max": 240.0}
_COST = {"bf16_time_s": 4.8e-07, "gemm_time_s": 2.4e-07, "cast_time_s": 3.6e-05, "time_s": 3.624e-05,
         "speedup_vs_bf16": 0.0133, "convertible": True, "pays": False, "note": None}
_FP8_MEASURED = {
    "recipes": {"fp8_tensorwise": {"description": "FP8, one scale per tensor", "source": "torchao tensorwise",
                                   "min_compute_capability": [8, 9], "torchao_recipe": "tensorwise"},
                "fp8_delayed": {"description": "FP8, amax history", "source": "TE DelayedScaling",
                                "min_compute_capability": [8, 9], "torchao_recipe": None}},
    "budget": {"max_local_rel_error": 0.05, "rule": "local output rel_l2 and per-token rel_l2 at most this"},
    "loss_fp32": 2.75,
    "loss": {"fp8_tensorwise": 2.7506, "fp8_delayed": None},
    "output_error": {"fp8_tensorwise": _M, "fp8_delayed": _M_INF},
    "history_steps": 4,
    "layers": [{"name": "fc1", "in_features": 64, "out_features": 128, "tokens": 32, "calls": 1, "recipes": {
        "fp8_tensorwise": {"local": {"output": _M, "grad_input": _M, "grad_weight": _M},
                           "local_per_token_rel_l2": 0.0376, "local_worst_token_rel_l2": 0.0467,
                           "accumulated": {"output": _M, "grad_weight": _M}, "accumulated_per_token_rel_l2": 0.0376,
                           "operands": {"output.input": _OP, "output.weight": _OP}, "loss_impact": -1.5e-05,
                           "stale_steps": None, "meets_budget": True},
        "fp8_delayed": {"local": {"output": _M_INF}, "local_per_token_rel_l2": None, "local_worst_token_rel_l2": None,
                        "accumulated": {}, "accumulated_per_token_rel_l2": 0.0, "operands": {"output.input": _OP},
                        "loss_impact": 0.0, "stale_steps": {"input": [0], "weight": [], "grad_output": []},
                        "meets_budget": False}}}],
    "notes": ["delayed scaling: the amax history holds 3 earlier FP32 step(s)"],
    "errors": {"fp8_delayed": "RuntimeError: the model failed under the recipe"},
    "other_gemms": [{"module": "attn", "op": "matmul", "index": 0, "a_shape": [4, 32, 16], "b_shape": [4, 16, 32],
                     "calls": 1, "gemm_flops": 131072, "recipes": {
                         "fp8_tensorwise": {"local": {"output": _M}, "operands": {"output.a": _OP, "output.b": _OP},
                                            "meets_budget": True},
                         "fp8_delayed": {"note": "not measured: delayed scaling keeps an amax history"}},
                     "plan": "kept in the plan's format: torchao converts only nn.Linear"}],
}
_FP8_DICT = {
    **_FP8_MEASURED,
    "plan": {"modules": {"fc1": {"recipe": "fp8_tensorwise", "reason": "fp8_tensorwise: local error 3.75e-02",
                                 "gemm_flops": 1572864, "cost": {"fp8_tensorwise": _COST}}},
             "fp8_flop_share": 1.0, "estimated_linear_speedup_vs_bf16": None, "tokens_per_step": {"fc1": 32},
             "verified": {"modules": {"fc1": "fp8_tensorwise"}, "loss": 2.7509, "loss_rel_change": 0.0002,
                          "output_rel_l2": 0.0448, "meets_budget": True},
             "dropped_for_budget": []},
    "target": {"name": "H100 SXM", "compute_capability": [9, 0],
               "recipes_supported": ["fp8_tensorwise", "fp8_delayed"]},
    "cost_assumptions": ["three GEMMs per step (output, grad_input, grad_weight)"],
    "torchao_auto_filter": {"fc1": {"fp8_tensorwise": False, "fp8_rowwise": False}},
}
# a model without nn.Linear: the plan written as null, with the note why; no target, assumptions or auto_filter
_FP8_UNPLANNED = {**_FP8_MEASURED, "layers": [], "plan": None, "plan_note": "not planned: the model has no nn.Linear"}


def _typed_fp8(planned: bool = True) -> F8.Fp8:
    def m(inf: bool = False) -> F8.Fp8Metrics:
        return (F8.Fp8Metrics(rel_l2=None, sqnr_db=None, max_abs=None, cosine=None, nonfinite=3, elements=4096) if inf
                else F8.Fp8Metrics(rel_l2=0.0375, sqnr_db=28.5, max_abs=0.027, cosine=0.9993, nonfinite=0,
                                   elements=4096))

    def op() -> F8.Fp8Operand:
        return F8.Fp8Operand(saturated_share=0.0, flushed_share=0.25, saturated=0, flushed=1024, nonzero=4096,
                             nonfinite=0, scale_min=123.5, scale_max=240.0)

    tensorwise = F8.Fp8LayerRecipe(
        local={"output": m(), "grad_input": m(), "grad_weight": m()}, local_per_token_rel_l2=0.0376,
        local_worst_token_rel_l2=0.0467, accumulated={"output": m(), "grad_weight": m()},
        accumulated_per_token_rel_l2=0.0376, operands={"output.input": op(), "output.weight": op()},
        loss_impact=-1.5e-05, stale_steps=None, meets_budget=True)
    delayed = F8.Fp8LayerRecipe(
        local={"output": m(inf=True)}, local_per_token_rel_l2=math.inf, local_worst_token_rel_l2=math.inf,
        accumulated={}, accumulated_per_token_rel_l2=0.0, operands={"output.input": op()}, loss_impact=0.0,
        stale_steps={"input": [0], "weight": [], "grad_output": []}, meets_budget=False)
    other = F8.Fp8OtherGemm(
        module="attn", op="matmul", index=0, a_shape=[4, 32, 16], b_shape=[4, 16, 32], calls=1, gemm_flops=131072,
        recipes={"fp8_tensorwise": F8.Fp8OtherGemmRecipe(local={"output": m()},
                                                         operands={"output.a": op(), "output.b": op()},
                                                         meets_budget=True),
                 "fp8_delayed": F8.Fp8OtherGemmRecipe(note="not measured: delayed scaling keeps an amax history")},
        plan="kept in the plan's format: torchao converts only nn.Linear")
    section = F8.Fp8(
        recipes={"fp8_tensorwise": F8.Fp8RecipeInfo(description="FP8, one scale per tensor",
                                                    source="torchao tensorwise", min_compute_capability=[8, 9],
                                                    torchao_recipe="tensorwise"),
                 "fp8_delayed": F8.Fp8RecipeInfo(description="FP8, amax history", source="TE DelayedScaling",
                                                 min_compute_capability=[8, 9], torchao_recipe=None)},
        budget=F8.Fp8Budget(max_local_rel_error=0.05, rule="local output rel_l2 and per-token rel_l2 at most this"),
        loss_fp32=2.75, loss={"fp8_tensorwise": 2.7506, "fp8_delayed": None},
        output_error={"fp8_tensorwise": m(), "fp8_delayed": m(inf=True)}, history_steps=4,
        layers=[F8.Fp8Layer(name="fc1", in_features=64, out_features=128, tokens=32, calls=1,
                            recipes={"fp8_tensorwise": tensorwise, "fp8_delayed": delayed})] if planned else [],
        notes=["delayed scaling: the amax history holds 3 earlier FP32 step(s)"],
        errors={"fp8_delayed": "RuntimeError: the model failed under the recipe"}, other_gemms=[other])
    if not planned:  # as fp8/audit.py sets it for a model without nn.Linear
        section.plan, section.plan_note = None, "not planned: the model has no nn.Linear"
        return section
    cost = F8.Fp8RecipeCost(bf16_time_s=4.8e-07, gemm_time_s=2.4e-07, cast_time_s=3.6e-05, time_s=3.624e-05,
                            speedup_vs_bf16=0.0133, convertible=True, pays=False, note=None)
    section.plan = F8.Fp8PlanReport(
        modules={"fc1": F8.Fp8ModulePlan(recipe="fp8_tensorwise", reason="fp8_tensorwise: local error 3.75e-02",
                                         gemm_flops=1572864, cost={"fp8_tensorwise": cost})},
        fp8_flop_share=1.0, estimated_linear_speedup_vs_bf16=None, tokens_per_step={"fc1": 32},
        verified=F8.Fp8Verified(modules={"fc1": "fp8_tensorwise"}, loss=2.7509, loss_rel_change=0.0002,
                                output_rel_l2=0.0448, meets_budget=True),
        dropped_for_budget=[])
    section.target = F8.Fp8Target(name="H100 SXM", compute_capability=[9, 0],
                                  recipes_supported=["fp8_tensorwise", "fp8_delayed"])
    section.cost_assumptions = ["three GEMMs per step (output, grad_input, grad_weight)"]
    section.torchao_auto_filter = {"fc1": {"fp8_tensorwise": False, "fp8_rowwise": False}}
    return section


def test_the_typed_fp8_section_writes_the_dicts_bytes():
    assert json.dumps(to_json(_typed_fp8()), indent=2) == json.dumps(_FP8_DICT, indent=2)
    # no nn.Linear: "plan" written as null (not left out), "plan_note" after it, nothing of the plan's after that
    assert json.dumps(to_json(_typed_fp8(planned=False)), indent=2) == json.dumps(_FP8_UNPLANNED, indent=2)


def test_a_saved_fp8_section_reads_typed_and_writes_back_unchanged():
    back = read(F8.Fp8, copy.deepcopy(_FP8_DICT))
    assert isinstance(back.plan, F8.Fp8PlanReport) and isinstance(back.plan.verified, F8.Fp8Verified)
    assert back.plan.modules["fc1"].cost["fp8_tensorwise"].time_s == 3.624e-05
    delayed = back.layers[0].recipes["fp8_delayed"]
    assert delayed.stale_steps == {"input": [0], "weight": [], "grad_output": []}
    assert delayed.local["output"] == F8.Fp8Metrics(None, None, None, None, 3, 4096)
    assert back.other_gemms[0].recipes["fp8_delayed"].note.startswith("not measured")
    assert back.other_gemms[0].recipes["fp8_tensorwise"].operands["output.b"].scale_max == 240.0
    assert back.torchao_auto_filter == {"fc1": {"fp8_tensorwise": False, "fp8_rowwise": False}}
    assert json.dumps(to_json(back)) == json.dumps(_FP8_DICT)
    unplanned = read(F8.Fp8, copy.deepcopy(_FP8_UNPLANNED))
    assert unplanned.plan is None and unplanned.target is None
    assert json.dumps(to_json(unplanned)) == json.dumps(_FP8_UNPLANNED)
    # the typed section as built equals the one read back (the non-finite per-token errors are None once stored)
    built = _typed_fp8()
    built.layers[0].recipes["fp8_delayed"].local_per_token_rel_l2 = None
    built.layers[0].recipes["fp8_delayed"].local_worst_token_rel_l2 = None
    assert back == built


def test_an_audit_with_an_fp8_section_passes_the_schema_and_reads_typed():
    doc = _stored("mlp")
    doc["fp8"] = copy.deepcopy(_FP8_DICT)
    record = from_json(copy.deepcopy(doc))
    assert isinstance(record.fp8, F8.Fp8) and record.fp8.layers[0].name == "fc1"
    again = to_json(record)
    assert again == doc  # the stored golden files are key-sorted: the fp8 section's own order is checked here
    assert json.dumps(again["fp8"], indent=1) == json.dumps(_FP8_DICT, indent=1)
