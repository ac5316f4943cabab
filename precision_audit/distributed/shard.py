"""The parallelism the audit runs the model under (docs/distributed.md, "Sharding").

- the model file's ``parallelize(model, mesh)``: the user's own FSDP2 / DDP / tensor-parallel wrapping. It may
  change ``model`` in place (``fully_shard``, ``parallelize_module``) and return nothing or the model, or return
  a wrapper (DDP) that the forward then goes through;
- ``--shard fsdp``: ``fully_shard`` on every child of the largest ``nn.ModuleList`` (the repeated blocks), then
  on the root;
- ``--shard ddp`` (the default): ``DistributedDataParallel``.

The audit's gradients are sums over ranks of each rank's share of the global loss (precision_audit/distributed/
session.py), so the averaging DDP and FSDP do is switched off: FSDP units get a gradient divide factor of 1,
DDP a comm hook that all-reduces with a sum. Module names stay ``named_modules()``'s of the unwrapped model
(fully_shard keeps them; a DDP wrapper is only what the forward calls).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ModelLoadError, OptionError

SHARD_CHOICES = ("ddp", "fsdp")


@dataclass
class Sharded:
    model: torch.nn.Module  # what the audit hooks and names (the user's model object)
    run_module: torch.nn.Module  # what the forward calls
    how: str
    original_types: dict[str, str]


def _sum_hook(state, bucket):  # noqa: ANN001 - DDP checks the annotations: none, or dist.GradBucket
    """DDP comm hook: all-reduce with a sum (DDP's default hook divides by the world size)."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


def largest_module_list(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList] | None:
    best: tuple[str, torch.nn.ModuleList] | None = None
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) and (best is None or len(m) > len(best[1])):
            best = (name, m)
    return best


def apply(model: torch.nn.Module, source: Any, shard: str | None, device: str,
          unused: list[str] | None = None) -> Sharded:
    """``unused``: the parameters no rank's loss reaches (unused.py), left out of DDP's reduction."""
    types_before = {n: type(m).__name__ for n, m in model.named_modules()}
    user = vars(source.module).get("parallelize")
    mesh_device = "cuda" if device.startswith("cuda") else "cpu"
    if user is not None:
        if shard is not None:
            raise OptionError("--shard cannot be combined with the model file's parallelize(model, mesh)",
                              found=f"--shard {shard} and parallelize() in {source.where}",
                              hint="drop --shard: parallelize() decides the wrapping")
        if not callable(user):
            raise ModelLoadError(f"parallelize in {source.where} is not callable",
                                 expected="def parallelize(model, mesh): ...")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(mesh_device, (dist.get_world_size(),))
        out = user(model, mesh)
        run = out if isinstance(out, torch.nn.Module) else model
        how = f"parallelize(model, mesh) in {source.where}"
    elif shard == "fsdp":
        from torch.distributed.fsdp import fully_shard

        blocks = largest_module_list(model)
        if blocks is not None:
            for child in blocks[1]:
                fully_shard(child)
        fully_shard(model)
        run = model
        how = (f"fully_shard on each of the {len(blocks[1])} blocks of '{blocks[0]}' and on the root" if blocks
               else "fully_shard on the root")
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        if not any(p.requires_grad for p in model.parameters()):
            run, how = model, "replicated (no trainable parameter to synchronise)"
        else:
            no_sync: dict[str, Any] = _no_buffer_sync_in_forward(DDP)
            if unused:  # no gradient to wait for (unused.py): DDP would never finish their buckets
                DDP._set_params_and_buffers_to_ignore_for_model(model, unused)
            run = DDP(model, find_unused_parameters=False, **no_sync)
            how = "DistributedDataParallel"
            if unused:
                shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
                how += f" ({len(unused)} parameter(s) no loss reaches left out of its reduction: {shown})"
    _sum_gradients(model, run)
    return Sharded(model=model, run_module=run, how=how, original_types=types_before)


def _no_buffer_sync_in_forward(ddp: Callable[..., Any]) -> dict[str, bool]:
    """DDP's option not to broadcast buffers at each forward: ``forward_sync_buffers`` from torch 2.13, which
    deprecates ``broadcast_buffers`` (older releases have only that one; it also skips the sync at construction,
    where every rank's buffers are the same model file's anyway)."""
    import inspect

    params = inspect.signature(ddp).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def _sum_gradients(model: torch.nn.Module, run: torch.nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel as DDP

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM nor AVG)
            # the root too: a forward without backward (the plan's verification) must not leave unsharded
            # parameters registered on the model between passes
            m.set_reshard_after_forward(True, recurse=False)
    if isinstance(run, DDP):
        try:
            run.register_comm_hook(None, _sum_hook)
        except RuntimeError as e:  # the user's parallelize registered its own hook
            raise OptionError("the DDP wrapper from parallelize() already has a communication hook",
                              found=str(e).splitlines()[0][:200],
                              hint="the audit sums gradients itself with a hook of its own; leave the hook out "
                                   "of parallelize()") from e

