"""The check every collective of the audit's own makes (precision_audit/distributed/lockstep.py), in one process:
a peer rank is simulated by the all-reduce (its tensor maxed with this rank's) and the all-gather (its report).

Across real ranks: tests/distributed/test_hostile_ranks.py (extra-module, loss-kind)."""

from __future__ import annotations

import pytest
import torch

from precision_audit.distributed import lockstep as L
from precision_audit.distributed.lockstep import Lockstep, diverged_error
from precision_audit.errors import ModelRunError


def _peer(monkeypatch, calls: list[str], label: str, values=(), detail=None) -> None:
    """The other rank: it called ``calls`` and reached ``label`` with ``values``."""
    other = Lockstep()
    for c in calls:
        other.called(c)

    def all_reduce(t, op=None, group=None):
        import zlib

        tag = zlib.crc32(label.encode(), other._crc)
        v = [float(x) for x in values] + [0.0] * (5 - len(values))
        theirs = torch.tensor([tag, -tag, *v, *(-x for x in v)], dtype=torch.float64)
        t.copy_(torch.maximum(t, theirs))

    def all_gather_object(out, mine, group=None):
        out[0], out[1] = mine, (label, calls, detail)

    monkeypatch.setattr(L.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(L.dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(L.dist, "get_world_size", lambda group=None: 2)


def test_ranks_at_the_same_point_get_the_maximum_and_minimum_of_their_values(monkeypatch):
    _peer(monkeypatch, ["fc", "out"], "the loss", values=[3.0, -1.0])
    me = Lockstep()
    me.called("fc")
    me.called("out")
    hi, lo = me.check("the loss", [5.0, -2.0])
    assert (hi, lo) == ([5.0, -1.0], [3.0, -2.0])
    assert me.calls == [], "the calls are counted from one check to the next"


def test_a_module_one_rank_ran_is_refused_by_name(monkeypatch):
    _peer(monkeypatch, ["fc", "extra"], "the loss")
    me = Lockstep()
    me.called("fc")
    me.called("out")
    with pytest.raises(ModelRunError) as e:
        me.check("the loss")
    assert L.DIVERGED in e.value.message
    assert "rank 0 called module 'out' where rank 1 called 'extra', before the loss" in e.value.message


def test_another_loss_kind_is_refused_by_name(monkeypatch):
    _peer(monkeypatch, [], "the loss (surrogate)")
    with pytest.raises(ModelRunError) as e:
        Lockstep().check("the loss (cross_entropy)")
    assert "rank 0 reached the loss (cross_entropy) where rank 1 reached the loss (surrogate)" in e.value.message


def test_refuse_receives_the_error():
    seen: list[ModelRunError] = []
    me = Lockstep(refuse=seen.append)
    err = diverged_error([("the statistics", [], ["a.activation", "b.activation"]),
                          ("the statistics", [], ["a.activation", "c.activation"])])
    assert "rank 0 has 'b.activation' where rank 1 has 'c.activation' (entry 2; 2 against 2 in all)" in err.message
    me.refuse(err)
    assert seen == [err]


@pytest.mark.parametrize("every,found", [
    ([("x", ["a"], None), ("x", ["a", "b"], None)], "rank 1 called module 'b', which rank 0 did not call there"),
    ([("x", ["a", "b"], None), ("x", ["a"], None)], "rank 0 called module 'b', which rank 1 did not call there"),
    ([("x", [], None), ("x", [], None), ("y", [], None)], "rank 0 reached x where rank 2 reached y"),
], ids=["extra-on-1", "missing-on-1", "third-rank"])
def test_what_differs_is_named(every, found):
    assert found in diverged_error(every).message


def test_at_most_five_values_ride_on_a_check():
    with pytest.raises(ValueError):
        Lockstep().check("x", [0.0] * 6)
