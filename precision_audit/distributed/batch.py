"""This rank's share of the global batch (docs/distributed.md, "The batch").

``--batch`` (or the model file's ``sample_batch()``) is the *global* batch. It is split along dimension 0, the
batch dimension, into ``world_size`` equal contiguous slices; rank r takes slice r, as a DistributedSampler
without shuffling would. The batch size is dimension 0 of the first tensor; every tensor whose dimension 0 has
that size is split, any other (a shared mask, a lookup table) is given whole to every rank. A batch size that
world_size does not divide is refused, naming both. A model file may instead define
``sample_batch(rank, world_size)`` returning this rank's share itself.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Any

import torch

from ..errors import BatchError
from ..loading import Batch, ModelSource, load_batch


@dataclasses.dataclass(frozen=True)
class Share:
    """This rank's batch and what it is of the global one."""

    batch: Batch
    global_size: int | None  # None: sample_batch(rank, world_size) gave the share directly
    local_size: int
    weight: float  # this rank's share of the global batch's samples: the weight of its mean loss
    how: str


def per_rank_sample_batch(source: ModelSource) -> bool:
    """Whether the model file defines ``sample_batch(rank, world_size)`` (two positional parameters)."""
    fn = vars(source.module).get("sample_batch")
    if not callable(fn):
        return False
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) >= 2


def rank_share(path: str | None, model: torch.nn.Module, source: ModelSource, rank: int, world: int) -> Share:
    """Load the global batch and keep this rank's slice, or call ``sample_batch(rank, world_size)``."""
    if path is None and per_rank_sample_batch(source):
        fn = vars(source.module)["sample_batch"]
        shim = types.ModuleType(source.module.__name__)
        shim.__dict__.update(vars(source.module))
        shim.sample_batch = lambda: fn(rank, world)  # type: ignore[attr-defined]
        batch = load_batch(None, model, dataclasses.replace(source, module=shim))
        n = _batch_size(batch)
        return Share(batch, None, n, -1.0, f"sample_batch({rank}, {world}) in the model file: {n} sample(s) on "
                                           f"rank {rank}")
    batch = load_batch(path, model, source)
    n = _batch_size(batch)
    if n % world:
        raise BatchError(
            f"the global batch does not split evenly across {world} ranks",
            expected=f"a batch size (dimension 0) that {world} divides",
            found=f"batch size {n} ({n // world} per rank and {n % world} left over)",
            hint=f"use a batch of {max(world, n - n % world)} or {n + world - n % world} samples, or define "
                 "sample_batch(rank, world_size) in the model file")
    size = n // world
    lo = rank * size
    memo: dict[int, Any] = {}

    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if id(x) not in memo:
                memo[id(x)] = x[lo:lo + size] if x.dim() and x.shape[0] == n else x
            return memo[id(x)]
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(cut(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(cut(v) for v in x)
        if isinstance(x, dict):
            return type(x)((k, cut(v)) for k, v in x.items())
        return x

    local = dataclasses.replace(batch, args=tuple(cut(a) for a in batch.args),
                                kwargs={k: cut(v) for k, v in batch.kwargs.items()},
                                target=cut(batch.target), raw=cut(batch.raw))
    return Share(local, n, size, size / n,
                 f"global batch of {n} split along dimension 0: samples {lo}..{lo + size - 1} on rank {rank}")


def _batch_size(batch: Batch) -> int:
    for _, t in batch.tensors():
        if t.dim():
            return int(t.shape[0])
    raise BatchError("the batch has no tensor with a batch dimension to split across ranks",
                     expected="tensors whose dimension 0 is the batch", found=str(batch.describe())[:200])
