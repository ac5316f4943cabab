"""precision_audit/distributed/compare.py: what may differ between a distributed audit and one process's."""

from __future__ import annotations

from precision_audit.distributed.compare import differences


def _layer(flushed: float, where: str) -> dict:
    grads = {where: {"fp16": {"unscaled": {"flushed": flushed}}}}
    return {"layers": [{"name": "blocks.0.attn.c_attn", "gradient": grads}]}


def test_parameter_gradient_fractions_may_differ_by_a_few_elements_and_nothing_else_may():
    one, two = 65 / 12480, 67 / 12480  # seen on an AVX-512 Xeon: 2 elements across fp16's flush threshold
    assert differences(_layer(one, "parameters"), _layer(two, "parameters")) == []
    # the same difference in an activation gradient (a per-element figure, not a sum across ranks) is reported
    assert differences(_layer(one, "outputs"), _layer(two, "outputs"))
    # and so is a parameter fraction off by more than 5e-4
    assert differences(_layer(one, "parameters"), _layer(one + 1e-3, "parameters"))


def _recheck(reason: str) -> dict:
    return {"noise_floor": {"rechecks": [{"decision": "fp16: safe as is", "reason": reason}]}}


def test_a_recheck_reasons_ratios_follow_the_loss_and_are_not_compared_but_its_margins_are():
    # seen on tests/distributed/test_distributed_audit.py's MLP: the loss change 801x and 796x below the budget
    # on one process and two ranks (the ranks add the loss in another order)
    reason = ("loss_rel_change {}x below (margin 10x), output_rel_error 95.9x below (margin 2x), "
              "first_order_sum_rel {}x below (margin 10x): the other order cannot carry them over")
    assert differences(_recheck(reason.format(801, "2.08e+03")), _recheck(reason.format(796, "2.07e+03"))) == []
    assert differences(_recheck(reason.format(801, 331)), _recheck(reason.format(801, 331).replace("2x", "4x")))
