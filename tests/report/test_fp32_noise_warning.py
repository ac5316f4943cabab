"""FP32 not reproducible within the budget (assemble.noise_warning, NoiseFloor.over_budget, the terminal's note).

A model and batch on which FP32 itself moves by more than the budget between two reduction orders (a random-init
LeViT at 2 x 64², whose BatchNorms see a few positions: its FP32 loss changes by 72% between 1 and 2 threads) makes
every format's figure, and the plan's verification, noise. The audit says so once; within the budget it says
nothing. The boundary is the budget itself, as for the formats (a change equal to the budget is within it)."""

from __future__ import annotations

import copy
import json
import math

import pytest

from precision_audit import assemble
from precision_audit.record import NoiseFloor
from precision_audit.record.codec import read
from precision_audit.report.terminal import summary_text

BUDGET = {"max_loss_rel_change": 1e-2, "max_output_rel_error": 5e-2}


def _noise(loss: float | None, out: float | None, layers: dict | None = None) -> NoiseFloor:
    return read(NoiseFloor, {
        "method": "the FP32 reference re-run with 1 CPU thread(s) instead of 2", "threads": [2, 1],
        "fp32_loss_rel": loss, "fp32_output_rel_error": out, "fp32_layers_rel_l2": layers or {},
        "second_order": {}, "rule": "r", "planner_impacts": None, "planner_impacts_wall_s": None})


def test_within_the_budget_nothing_is_said():
    assert assemble.noise_warning(None, BUDGET) == []
    assert assemble.noise_warning(_noise(3e-7, 2e-6), BUDGET) == []
    assert assemble.noise_warning(_noise(1e-2, 5e-2), BUDGET) == []  # equal to the budget: within it


@pytest.mark.parametrize("loss,out,said", [
    (0.715, 1.39, ["the loss by 7.15e-01 (budget 1.00e-02)", "the output by 1.39e+00 (budget 5.00e-02)"]),
    (1.0001e-2, 1e-3, ["the loss by 1.00e-02 (budget 1.00e-02)"]),
    (1e-4, 0.06, ["the output by 6.00e-02 (budget 5.00e-02)"]),
    (math.nan, None, ["the loss by nan (budget 1.00e-02)"]),
])
def test_beyond_the_budget_fp32s_own_change_is_a_warning(loss, out, said):
    noise = _noise(loss, out, {"stem": 1e-7, "blocks.2": 0.19, "head": 2.6})
    assert noise.over_budget(BUDGET) == said
    (w,) = assemble.noise_warning(noise, BUDGET)
    assert w.startswith("FP32 is not reproducible on this model and batch") and " and ".join(said) in w
    assert "the first to move beyond the output budget is blocks.2" in w  # of the sampled layers, in order


def test_the_terminal_says_it_under_the_fp32_row(sample_audits):
    _, out, _ = sample_audits.get("mlp")
    audit = json.loads((out / "audit.json").read_text())
    assert audit["noise_floor"]["fp32_loss_rel"] < 1e-2  # the sample: FP32 reproducible, nothing said
    assert "not reproducible" not in summary_text(audit)
    assert not any("not reproducible" in w for w in audit["warnings"])
    a = copy.deepcopy(audit)
    a["noise_floor"]["fp32_loss_rel"] = 0.715
    lines = summary_text(a).splitlines()
    i = next(i for i, line in enumerate(lines) if line.split()[:1] == ["fp32"])
    assert lines[i + 1].startswith("  note: FP32 itself is not reproducible here") and "7.15e-01" in lines[i + 1]
