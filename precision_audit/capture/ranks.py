"""The capture session's one hook for an audit split over ranks: what it asks at fixed points of every pass.

A single-process audit measures the whole batch in one process. A distributed audit (precision_audit/distributed/,
docs/distributed.md) runs the same session on each rank's share of the batch, and must reduce every pass's
statistics across ranks, count a tensor every rank holds alike once, and keep the ranks in step. The session
takes those differences as one object, :class:`Ranks`, and calls it at the points below and nowhere else; it
never lets another class override its own methods. :class:`Ranks` itself is the single-process answer (nothing to
reduce, every statistic counted here); the distributed audit hands its subclass
(precision_audit/distributed/session.py, ``RankReductions``).

The session hands the hook what it may read once, in :meth:`Ranks.bind`: its call stack (the module calls running
now, and their names), its store of FP32 references, and how a gradient's non-finite elements are counted against
FP32's. Everything else reaches a hook as an argument at the point it is called.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ..formats import Format
from .calls import CallStack

if TYPE_CHECKING:
    from .records import LayerRecord, RunRecord
    from .reference_store import Kept, ReferenceStore
    from .stats import MagnitudeHistogram

T = TypeVar("T")
#: a module output's gradient hook (capture/session.py, ``_grad_hook``): called with dL/dy, or None
GradHook = Callable[[torch.Tensor], None]
#: how the session makes one: (the module's record, its re-runs' differences per format, (slot, the output weakly))
MakeGradHook = Callable[["LayerRecord", "dict[Format, Any] | None", "tuple[int, Any] | None"], GradHook]


def tensor_key(t: Kept) -> tuple:
    """What a tensor's statistics are cached under within a pass (a hit must also be the very tensor: its id and
    address may be a freed tensor's)."""
    return (id(t), t._version, t.data_ptr(), tuple(t.shape), t.dtype)


class Ranks:
    """One process holds the whole batch: every hook is the identity. Subclassed by the distributed audit (module
    docstring); each method says where the session calls it."""

    #: whether a call on the batch itself takes its local error from the format passes instead of a re-run
    #: (capture/reference_pass.py, BatchCall); over ranks the re-runs' figures are added up after the reference pass
    batch_calls = True
    #: whether the second order's backward asks for the module outputs' gradients only (reference_pass.py,
    #: _reference_backward); over ranks FSDP2's hooks need every parameter's gradient
    outputs_only_backward = True

    def bind(self, calls: CallStack, refs: ReferenceStore,
             grad_nonfinite: Callable[[torch.Tensor, torch.Tensor], tuple[int, int]]) -> None:
        """Once, as the session is made: its call stack, its FP32 references' store, and its count of a
        parameter gradient's non-finite elements (added, shared with FP32's)."""

    def module_called(self, name: str) -> None:
        """A module call starts in a measured pass (not a local re-run, not a timed step)."""

    def reset(self) -> None:
        """Every pass's fresh start, after the session's own."""

    def counted_here(self, t: Kept, label: Callable[[], str]) -> bool:
        """Whether a statistic of ``t`` (during a pass) is counted in this process; ``label()`` names it."""
        return True

    def outputs(self, name: str, ys: list[torch.Tensor]) -> None:
        """A measured module call ended with outputs ``ys``, before their statistics and gradient hooks."""

    def local_rerun(self, rec: LayerRecord, ys: list[torch.Tensor], rerun: Callable[[], T]) -> T:
        """The module's re-runs alone per format (``rerun()``), for the call whose outputs are ``ys``."""
        return rerun()

    def grad_hook(self, rec: LayerRecord, diffs: dict[Format, Any] | None, own: tuple[int, Any] | None,
                  make: MakeGradHook) -> GradHook:
        """The gradient hook of one of ``rec``'s outputs (``make`` is the session's own)."""
        return make(rec, diffs, own)

    def param_grads_taken(self, layers: dict[int, LayerRecord], modules: dict[int, torch.nn.Module],
                          grad_all: MagnitudeHistogram, fp32_nonfinite: dict[int, torch.Tensor]) -> None:
        """After the reference pass's parameter-gradient histograms of the gradients still held: any taken
        before (merged into ``layers``, ``grad_all`` and ``fp32_nonfinite`` as those are)."""

    def grads_nonfinite_taken(self, fmt: Format, run: RunRecord, layers: dict[int, LayerRecord],
                              modules: dict[int, torch.nn.Module]) -> None:
        """After a format pass's non-finite parameter-gradient counts of the gradients still held: any taken."""

    @contextlib.contextmanager
    def reference_pass(self, impacts_only: bool) -> Iterator[None]:
        """Around the reference pass (``impacts_only``: its repeat at the second reduction order)."""
        yield

    def reference_done(self, layers: list[LayerRecord], grad_all: MagnitudeHistogram) -> MagnitudeHistogram:
        """After the reference pass: its records final; returns the histogram of every parameter gradient."""
        return grad_all

    @contextlib.contextmanager
    def format_pass(self, fmt: Format) -> Iterator[Any]:
        """Around a format pass (and around its retry with the fp32-fallback kernels, inside it); what it yields
        goes back to :meth:`format_done`."""
        yield None

    def format_done(self, fmt: Format, loss_scale: float, run: RunRecord, started: Any,
                    layers: dict[int, LayerRecord], root: LayerRecord | None) -> None:
        """After a format pass returned ``run``; ``root``: the whole model's record."""
