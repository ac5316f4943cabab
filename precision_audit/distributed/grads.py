"""Parameter gradients taken as FSDP2 hands them over, then freed (docs/distributed.md, "Memory per rank").

Under FSDP2 each rank ends a backward holding its shard of every parameter's gradient: as many bytes as its
shard of the parameters, so with 2 ranks parameters and gradients together are as large as the whole model. The
audit reads each parameter gradient once, for statistics that do not depend on the order in which they are read
(exact histogram counts and maxima in the FP32 pass, non-finite counts in the format passes). So
:class:`GradTaker` takes them from the sharded parameter's post-accumulate-grad hook, which FSDP2 calls right
after the reduce-scatter has written that shard, and sets ``grad`` back to ``None``: the unit's reduce-scatter
output is released before the next unit's gradients arrive, and a rank never holds more than one unit's sharded
gradients. The session then merges what was taken exactly as it merges the gradients still held
(precision_audit/distributed/session.py), so every reported figure is the one the gradients left in place give.

A gradient is taken only where that is exact: its parameter belongs to an FSDP unit whose forward ran once with
autograd on in this pass (a unit called twice gets two reduce-scatters accumulated into one gradient, which is
left to accumulate and is read after the backward, as are DDP's and any gradient no FSDP unit owns).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..capture.calls import CallStack
from ..capture.stats import MagnitudeHistogram
from ..formats import Format
from .tensors import owned_part


class GradTaker:
    """Post-accumulate-grad hooks on every FSDP2-sharded parameter of the session's model (module docstring).

    ``phase`` says what a gradient is read for: ``"ref"`` (its histogram, and where it is not finite), a
    :class:`Format` (non-finite elements the format adds), or ``None`` (nothing: the second-order repeat of the
    FP32 pass, timed steps); it is freed in every case. ``calls``: the session's call stack (a local re-run
    registers no reduce-scatter); ``grad_nonfinite``: the session's count of a gradient's non-finite elements
    (added, shared with FP32's: capture/format_pass.py)."""

    def __init__(self, calls: CallStack, grad_nonfinite: Callable[[torch.Tensor, torch.Tensor], tuple[int, int]]
                 ) -> None:
        self.calls = calls
        self.grad_nonfinite = grad_nonfinite
        self.phase: Format | str | None = None
        self.histograms: dict[int, tuple[MagnitudeHistogram, torch.Tensor | None]] = {}
        self.nonfinite: dict[int, tuple[int, int]] = {}
        self._unit_of: dict[int, int] = {}  # id(parameter) -> id(its FSDP unit)
        self._calls: dict[int, int] = {}  # id(unit) -> its forwards with autograd on in this pass
        self._handles: list[Any] = []

    def install(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit in reversed(units):  # inner units first: a parameter belongs to the innermost unit holding it
            for p in unit.parameters():
                self._unit_of.setdefault(id(p), id(unit))
            # prepended: runs before the hooks that mark FSDP's own work as untracked (session.Untracked)
            self._handles.append(unit.register_forward_pre_hook(self._count, prepend=True))
        for p in model.parameters():
            if isinstance(p, DTensor) and p.requires_grad and id(p) in self._unit_of:
                self._handles.append(p.register_post_accumulate_grad_hook(self._take))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def reset(self) -> None:
        """Before every pass (RankReductions.reset, precision_audit/distributed/session.py)."""
        self.histograms.clear()
        self.nonfinite.clear()
        self._calls.clear()

    def _count(self, module: torch.nn.Module, args: Any) -> None:
        # a local re-run (no autograd) and a forward without autograd register no backward reduce-scatter
        if torch.is_grad_enabled() and not self.calls.rerunning:
            self._calls[id(module)] = self._calls.get(id(module), 0) + 1

    def _take(self, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None or self._calls.get(self._unit_of.get(id(p), -1), 0) != 1:
            return  # left in place: read after the backward, as without this hook
        if self.phase == "ref":
            h = MagnitudeHistogram()
            h.update(owned_part(grad))  # what the reference pass counts (capture/reference_pass.py)
            mask = ~torch.isfinite(owned_part(grad).detach()) if h.nonfinite else None
            self.histograms[id(p)] = (h, mask)
        elif isinstance(self.phase, Format):
            self.nonfinite[id(p)] = self.grad_nonfinite(p, grad)
        p.grad = None
