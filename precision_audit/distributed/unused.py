"""Parameters the loss does not reach, found before DistributedDataParallel wraps the model (docs/distributed.md,
"Parameters no loss reaches").

DDP, as the audit builds it (``find_unused_parameters=False``: DDP's ``_DDPSink`` would otherwise copy every
output and its traversal warn on every model that has none), waits in each backward for a gradient of every
parameter it reduces. A parameter no forward uses (BERT's pooler under a masked-LM head, a head kept for another
task) never gets one: the bucket holding it is never reduced, and the next forward raises "Expected to have
finished reduction in the prior iteration", so that every format pass fails and the plan falls back to FP32.

So before wrapping, each rank runs one forward of its batch share with autograd recording (in the model's own
mode, as the passes run it; its buffers, attributes and hooks put back after and every generator forked: nothing
of the model or the RNG changes), computes the loss the audit will use,
walks the loss's autograd graph to the parameters it reaches, and the ranks agree on the rest. Those parameters
are left out of DDP's reduction (they have no gradient to reduce): a model whose every parameter is used is wrapped
exactly as before. A rank that uses a parameter another does not is refused with its name (DDP cannot reduce
it; ``--shard fsdp`` can). A graph holding a reentrant checkpoint hides the parameters inside it from the walk:
then nothing is left out (as before).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import host_rng
from ..errors import ModelRunError

log = logging.getLogger(__name__)


def _memory(t: torch.Tensor) -> tuple | None:
    """Where a tensor's values live: device, dtype, address, shape and strides (None for one without memory)."""
    if t.is_meta or not t.numel():
        return None
    ptr = t.data_ptr()
    return (t.device, t.dtype, ptr, tuple(t.shape), tuple(t.stride())) if ptr else None


@dataclass
class Reached:
    """The leaves a loss's graph accumulates gradients into, by Python object and by memory: on torch 2.11 with CUDA
    (an H200, 2026-11-28) ``AccumulateGrad.variable`` gave other Python objects than the model's parameters, so
    that matching by ``id`` alone found none reached and DDP refused a model it thought had nothing to train
    (docs/distributed.md, "Parameters no loss reaches")."""

    ids: set[int] = field(default_factory=set)
    memory: set[tuple] = field(default_factory=set)

    def add(self, t: torch.Tensor) -> None:
        self.ids.add(id(t))
        key = _memory(t)
        if key is not None:
            self.memory.add(key)

    def __contains__(self, t: object) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if id(t) in self.ids:
            return True
        key = _memory(t)
        return key is not None and key in self.memory

    def __len__(self) -> int:
        return len(self.ids)


def reached_parameters(loss: torch.Tensor) -> Reached | None:
    """The leaf tensors ``loss``'s autograd graph accumulates gradients into; None when the graph holds a reentrant
    checkpoint (its forward ran without recording, so the parameters inside are not in the graph)."""
    reached = Reached()
    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if "CheckpointFunction" in type(node).__name__:
            return None
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it accumulates into
        if isinstance(variable, torch.Tensor):
            reached.add(variable)
        stack.extend(fn for fn, _ in node.next_functions)
    return reached


@contextlib.contextmanager
def _untouched(model: torch.nn.Module, device: str) -> Iterator[None]:
    """The trial forward in the model's own mode (the passes' graph: a parameter used only in training counts as
    used), with its buffers, attributes and hooks put back after (capture/model_state.py, as the passes do) and
    every generator forked."""
    from ..capture.model_state import ModelState

    state = ModelState(model, device)
    devices = [torch.cuda.current_device()] if device.startswith("cuda") else []
    try:
        with torch.random.fork_rng(devices=devices), host_rng.fork(), torch.enable_grad():
            state.prepare()
            yield
    finally:
        state.restore()


#: how an exception of the model in this forward is named to the user (distributed/failure.py's model_raised)
PART = "forward that finds the parameters no loss reaches"


def unused_parameters(model: torch.nn.Module, source: Any, batch: Any, device: str,
                      raised: Callable[[BaseException], None]) -> list[str] | None:
    """This rank's trainable parameters that its loss does not reach, by name; None when that cannot be told (a
    reentrant checkpoint; or the forward raised on every rank alike: ``raised(e)`` returned, and the audit's first
    pass meets the same error and reports it as one process would. Where only some ranks raised, ``raised`` ends
    the audit naming the rank)."""
    from ..loading import resolve_loss

    try:
        with _untouched(model, device):
            batch = batch.to(device)
            out = model(*batch.args, **batch.kwargs)
            loss = resolve_loss(source, out, batch)(out, batch)
            reached = reached_parameters(loss) if loss.requires_grad else None
            del out, loss
            # matched while the parameters are where the forward used them (a model moved for this forward only
            # is put back after it)
            trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            unused = [n for n, p in trainable if reached is not None and p not in reached]
    except Exception as e:
        raised(e)
        return None
    if reached is None:
        return None
    if trainable and len(unused) == len(trainable):
        # the loss needs gradients yet reaches none of the parameters: not a model DDP could train, so rather a
        # graph this walk cannot read; leave nothing out (DDP's own checks then apply, as before this check)
        log.warning("the loss's autograd graph reaches %d leaf tensor(s) but none of the model's %d trainable "
                    "parameters; no parameter is left out of DDP's reduction", len(reached), len(trainable))
        return None
    return unused


def agreed_unused(model: torch.nn.Module, source: Any, batch: Any, device: str,
                  raised: Callable[[BaseException], None]) -> list[str]:
    """The parameters every rank's loss leaves unreached (all ranks call this together); [] when any rank cannot
    tell. A parameter unused on some ranks and used on others is a :class:`ModelRunError`."""
    mine = unused_parameters(model, source, batch, device, raised)
    every: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if any(u is None for u in every):
        return []
    sets = [set(u or ()) for u in every]
    common = set.intersection(*sets)
    for rank, s in enumerate(sets):
        if s != common:
            name = sorted(s - common)[0]
            user = next(r for r, t in enumerate(sets) if name not in t)
            raise ModelRunError(
                f"parameter '{name}' gets no gradient from rank {rank}'s share of the batch but does from rank "
                f"{user}'s: DistributedDataParallel cannot reduce a parameter only some ranks use",
                expected="every parameter reached by the loss on every rank, or on none",
                found=f"'{name}' unused on rank {rank}, used on rank {user}",
                hint="audit with --shard fsdp (FSDP reduces such parameters), or give every rank a batch share "
                     "that uses the same parameters")
    return [n for n, _ in model.named_parameters() if n in common]
