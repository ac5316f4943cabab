"""Every collective of the audit's own checks first that every rank is at the same point of the same computation.

A rank whose model took another path (ran a module its peers did not, computed another kind of loss) would
otherwise pair its collectives with unrelated ones of its peers: sums of unrelated numbers, or, when the sizes
differ, gloo aborting the process in C++. So each of the audit's collectives (the session's and the reduction's,
precision_audit/distributed/session.py and reduce.py) starts with one small all-reduce that carries a tag: a
CRC of what the collective is ("the output of 'fc'", "the loss: cross_entropy", "the statistics of the fp16
pass") and of the modules this rank called since the previous check. Up to five values ride along (reduced to
their maximum and minimum), so the check is often the collective itself. When the tags differ, every rank sees it
in the same collective, the ranks exchange what they did, and the audit is refused naming the modules
(docs/distributed.md, "Failures"): before any figure of the diverging pass is reduced.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ModelRunError

_VALUES = 5
DIVERGED = "the ranks ran different computations"
_HINT = ("a model whose modules run (or fail) depending on the data cannot be audited across ranks; audit it in one "
         "process, or give every rank a batch that takes the same path")


def _raise(e: ModelRunError) -> None:
    raise e


class Lockstep:
    """The checks of one rank's audit (module docstring). ``refuse`` receives the error of a divergence (the
    distributed run ends the audit with it: precision_audit/distributed/failure.py); ``done`` counts the checks
    (the watchdog reads it to tell a rank waiting in one collective from one passing through many)."""

    def __init__(self, group: Any = None, refuse: Callable[[ModelRunError], None] = _raise,
                 done: Callable[[], None] | None = None) -> None:
        self.group = group
        self.refuse = refuse
        self._done = done
        self.calls: list[str] = []
        self._crc = 0

    def called(self, name: str) -> None:
        """A module call this rank's model made (its ``named_modules()`` name)."""
        self.calls.append(name)
        self._crc = zlib.crc32(name.encode(errors="replace") + b"\n", self._crc)

    def check(self, label: str, values: Sequence[float] = (), detail: Sequence[str] | None = None
              ) -> tuple[list[float], list[float]]:
        """One collective: every rank is at ``label`` and called the same modules since the previous check.
        Returns the maximum and the minimum over ranks of each of ``values`` (at most five). ``detail``: what to
        compare entry by entry when the ranks differ (a reduction's list of fields)."""
        if len(values) > _VALUES:
            raise ValueError(f"at most {_VALUES} values ride on a check, got {len(values)}")
        tag = zlib.crc32(label.encode(errors="replace"), self._crc)
        v = [float(x) for x in values] + [0.0] * (_VALUES - len(values))
        t = torch.tensor([tag, -tag, *v, *(-x for x in v)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        if self._done is not None:
            self._done()
        calls = self.calls
        self.calls, self._crc = [], 0
        if int(t[0]) != tag or int(-t[1]) != tag:
            self.refuse(self._diverged(label, calls, list(detail) if detail is not None else None))
            raise AssertionError("refuse() returned")  # pragma: no cover - refuse ends the rank or raises
        got = t.tolist()
        return got[2:2 + _VALUES][:len(values)], [-x for x in got[2 + _VALUES:]][:len(values)]

    def _diverged(self, label: str, calls: list[str], detail: list[str] | None) -> ModelRunError:
        """Every rank is here (they all saw the tags differ in the same collective): gather what each did."""
        mine = (label, calls, detail)
        every: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, mine, group=self.group)
        return diverged_error(every)


def diverged_error(every: list[Any]) -> ModelRunError:
    """The refusal for ranks that each reported ``(label, module calls since the last check, detail)``."""
    label0, calls0, detail0 = every[0]
    q = next((r for r, e in enumerate(every) if e != every[0]), 1)
    label, calls, detail = every[q]
    if calls != calls0:
        i = next((i for i, (a, b) in enumerate(zip(calls0, calls)) if a != b), min(len(calls0), len(calls)))
        if i < len(calls0) and i < len(calls):
            what = f"rank 0 called module '{calls0[i]}' where rank {q} called '{calls[i]}'"
        elif i < len(calls):
            what = f"rank {q} called module '{calls[i]}', which rank 0 did not call there"
        else:
            what = f"rank 0 called module '{calls0[i]}', which rank {q} did not call there"
        found = what + (f", before {label0}" if label0 == label else "")
    elif label != label0:
        found = f"rank 0 reached {label0} where rank {q} reached {label}"
    else:
        d0, d = detail0 or [], detail or []
        i = next((i for i, (a, b) in enumerate(zip(d0, d)) if a != b), min(len(d0), len(d)))
        found = (f"in {label0}: rank 0 has {d0[i] if i < len(d0) else '(nothing more)'!r} where rank {q} has "
                 f"{d[i] if i < len(d) else '(nothing more)'!r} (entry {i + 1}; {len(d0)} against {len(d)} in all)")
    return ModelRunError(f"{DIVERGED}, so their statistics cannot be added up", found=found, hint=_HINT)
