"""The planner on hand-built findings: no model runs here."""

from __future__ import annotations

import itertools

import pytest

from precision_audit.formats import Format
from precision_audit.planning.planner import Candidate, plan_formats

BF, FP, F32 = Format.BF16, Format.FP16, Format.FP32


def cand(name, impact_bf=1e-6, impact_fp=1e-7, flops=1000, overflow=None, group=None, t32=10.0, tlow=1.0):
    return Candidate(name=name, flops=flops, time_s={F32: t32, BF: tlow, FP: tlow},
                     impact={BF: impact_bf, FP: impact_fp}, overflow=overflow or {}, group=group)


def test_everything_low_precision_when_the_budget_allows():
    cs = [cand(f"l{i}") for i in range(5)]
    r = plan_formats(cs, (BF, FP), reference_loss=1.0, max_loss_rel_change=1e-2)
    assert {d.format for d in r.decisions.values()} == {BF}, "bf16 preferred over fp16 at equal cost"
    assert r.predicted_loss_change <= r.loss_budget
    assert all(d.reason for d in r.decisions.values())


def test_budget_respected_by_promoting_the_sensitive_modules():
    cs = [cand(f"l{i}") for i in range(6)] + [cand("hot1", impact_bf=5e-3, impact_fp=4e-3),
                                                cand("hot2", impact_bf=8e-3, impact_fp=6e-3)]
    r = plan_formats(cs, (BF, FP), reference_loss=1.0, max_loss_rel_change=1e-3)
    assert r.predicted_loss_change <= r.loss_budget
    assert r.decisions["hot1"].format is F32 and r.decisions["hot2"].format is F32
    assert all(r.decisions[f"l{i}"].format is BF for i in range(6))
    assert "budget" in r.decisions["hot2"].reason and "%" in r.decisions["hot2"].reason


def test_a_cheaper_fix_than_fp32_is_taken_when_it_exists():
    # fp16 has 8x less rounding error than bf16 at the same speed: switching to it fixes the budget for free
    cs = [cand("a", impact_bf=4e-3, impact_fp=5e-4)]
    r = plan_formats(cs, (BF, FP), reference_loss=1.0, max_loss_rel_change=1e-3)
    assert r.decisions["a"].format is FP


def test_overflowing_formats_are_never_chosen():
    cs = [cand("hot", overflow={FP: "fp16 output reaches 1.2e5 > 65504"}, impact_bf=1.0),
          cand("cold", overflow={FP: "x", BF: "y"})]
    r = plan_formats(cs, (FP,), reference_loss=1.0, max_loss_rel_change=10.0)
    assert r.decisions["hot"].format is F32 and "65504" in r.decisions["hot"].reason
    r2 = plan_formats(cs, (BF, FP), reference_loss=1.0, max_loss_rel_change=10.0)
    assert r2.decisions["hot"].format is BF and r2.decisions["cold"].format is F32
    for res in (r, r2):
        for name, d in res.decisions.items():
            c = next(c for c in cs if c.name == name)
            assert d.format not in c.overflow


def test_tied_modules_share_one_format():
    cs = [cand("wte", impact_bf=2e-3, group="tied"), cand("lm_head", impact_bf=1e-6, group="tied"),
          cand("other")]
    r = plan_formats(cs, (BF,), reference_loss=1.0, max_loss_rel_change=1e-3)
    assert r.decisions["wte"].format == r.decisions["lm_head"].format == F32
    assert "shares parameters" in r.decisions["lm_head"].reason
    assert r.decisions["other"].format is BF


def test_unmeasured_impact_is_not_chosen_blindly():
    c = Candidate("m", 10, {F32: 10.0, BF: 1.0}, {BF: None}, {})
    r = plan_formats([c], (BF,), reference_loss=1.0, max_loss_rel_change=1.0)
    assert r.decisions["m"].format is F32 and "not measured" in r.decisions["m"].reason


def test_deterministic_whatever_the_input_order():
    cs = [cand(f"l{i}", impact_bf=1e-3) for i in range(4)]
    results = set()
    for perm in itertools.permutations(cs):
        r = plan_formats(list(perm), (BF, FP), reference_loss=1.0, max_loss_rel_change=2.5e-3)
        results.add(tuple(sorted((n, d.format.value) for n, d in r.decisions.items())))
    assert len(results) == 1


def test_promotion_order_is_by_saving_per_unit_time():
    # same impact, but promoting "cheap" to fp32 costs little time: it goes first
    cs = [cand("cheap", impact_bf=2e-3, impact_fp=2e-3, t32=1.1), cand("dear", impact_bf=2e-3, impact_fp=2e-3, t32=50)]
    r = plan_formats(cs, (BF, FP), reference_loss=1.0, max_loss_rel_change=3e-3)
    assert r.decisions["cheap"].format is F32 and r.decisions["dear"].format is BF


@pytest.mark.parametrize("loss", [0.5, 3.0])
def test_budget_is_relative_to_the_reference_loss(loss):
    cs = [cand("a", impact_bf=1e-3 * loss, impact_fp=1e-3 * loss)]
    assert plan_formats(cs, (BF,), loss, 2e-3).decisions["a"].format is BF
    assert plan_formats(cs, (BF,), loss, 5e-4).decisions["a"].format is F32
