"""Which part of a tensor this rank counts, so that per-rank statistics add up to the whole tensor's.

In a distributed audit (docs/distributed.md) every statistic is a sum over ranks. A parameter's gradient is not
split along the batch like an activation: under FSDP2 each rank holds a shard of it (a ``DTensor`` with a
``Shard`` placement), under DDP every rank holds the same all-reduced copy. :func:`owned_part` returns the
elements this rank is responsible for: its shard, or, for a replicated tensor, the whole tensor on the first
rank of its group and nothing elsewhere. Outside a distributed audit it returns the tensor unchanged.

These helpers live in capture/ because the capture session counts with them (docs/architecture.md: a stage
imports the stages before it, never after); precision_audit/distributed/tensors.py re-exports them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

#: Set by the distributed audit while it runs (precision_audit/distributed/run.py): {'rank': rank}.
_REPLICATED_OWNER: dict[str, int] = {}


def set_replicated_owner(rank: int | None) -> None:
    """While a distributed audit runs, replicated (non-DTensor) parameter tensors are counted by rank 0 only."""
    _REPLICATED_OWNER.clear()
    if rank is not None:
        _REPLICATED_OWNER["rank"] = rank


def owned_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's share of a parameter or gradient tensor (the whole tensor outside a distributed audit)."""
    # No DTensor can exist before its module is imported (FSDP2 and transformers import it; a plain model does
    # not): importing it here would cost an audit of such a model ~0.7 s (docs/performance.md).
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        replicate = dtensor.Replicate
        local = t.to_local()
        coords: Sequence[int] = t.device_mesh.get_coordinate() or []
        # a mesh dimension the tensor is replicated on: only coordinate 0 along it counts
        for dim, placement in enumerate(t.placements):
            if isinstance(placement, replicate) and dim < len(coords) and coords[dim] != 0:
                return local.new_empty((0,))
        return local
    if _REPLICATED_OWNER.get("rank", 0) != 0:
        return t.new_empty((0,))
    return t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds: a ``DTensor``'s local shard, any other tensor itself (for storage checks)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None and type(t).__name__ == "DTensor" else t
