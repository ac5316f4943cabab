"""RankReductions.replicated is a collective, cached per tensor within a pass. The cache is keyed by
(id, version, address, shape, dtype); a tensor freed and a new one given the same id and address on one rank only
made that rank answer from the cache and skip the all_reduce the other rank entered: a deadlock (seen as a hung
tests/distributed/test_distributed_meta.py run). A hit must now be the very tensor."""

from __future__ import annotations

import weakref

import torch

from precision_audit.capture.ranks import tensor_key
from precision_audit.distributed import session as dsession
from precision_audit.distributed.lockstep import Lockstep


def _bare(monkeypatch) -> tuple[dsession.RankReductions, list]:
    monkeypatch.setattr(dsession.dist, "get_rank", lambda group=None: 0)
    s = dsession.RankReductions(Lockstep())
    calls: list = []
    monkeypatch.setattr(dsession.dist, "all_reduce", lambda t, op=None, group=None: calls.append(op))
    return s, calls


def test_the_same_tensor_is_asked_once(monkeypatch):
    s, calls = _bare(monkeypatch)
    t = torch.ones(4)
    assert s.replicated(t) is True and len(calls) == 1  # max and -min in one: one rank alone is "the same everywhere"
    assert s.replicated(t) is True and len(calls) == 1  # answered from the cache, no collective


def test_a_stale_entry_under_the_same_key_is_not_an_answer(monkeypatch):
    s, calls = _bare(monkeypatch)
    t, other = torch.ones(4), torch.ones(4)
    # what a freed tensor leaves when the new one gets its id and address: the key matches, the object does not
    s._same_everywhere[tensor_key(t)] = (weakref.ref(other), False)
    assert s.replicated(t) is True and len(calls) == 1  # asked again, as every other rank does
