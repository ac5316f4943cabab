"""The state and helpers that the parts of a capture session share, declared once for the type checker.

:class:`~precision_audit.capture.session.CaptureSession` is assembled from parts (the reference pass in
reference_pass.py, the format passes in format_pass.py) that read and write the session's per-pass state and
call its helpers. :class:`SessionState` declares those names with their types; the session sets the values
(in ``CaptureSession.__init__``) and defines the helpers. It holds no state and no code of its own
(docs/architecture.md, "capture/").
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from ..formats import Format
from ..host_rng import HostRng
from .calls import CallStack
from .output_grads import OutputGradHooks
from .ranks import Ranks
from .records import LayerRecord, RunRecord
from .reference_store import Kept, ReferenceStore
from .stats import ErrorStats, MagnitudeHistogram, RangeSummary
from .user_autocast import UserAutocast

# torch's CPU generator, the device's CUDA generator (cuda mode), Python's and NumPy's (precision_audit/host_rng.py)
RngState = tuple[torch.Tensor, torch.Tensor | None, HostRng]


@dataclass
class StepControls:
    """What the step timer (capture/timing.py) may do to the session's runs, handed over by the session: the timer
    calls these and reads the call stack's names, and sees nothing else of the session's own state."""

    calls: CallStack
    reset: Callable[[], None]  # every pass's fresh start (buffers, generators, caches)
    install_hooks: Callable[[], None]  # the session's module hooks, on
    remove_hooks: Callable[[], None]  # and off (the clean steps run without them)
    set_phase: Callable[[Format | str | None], None]  # "profile": the hooks time each module for the timer
    fp32_switches: Callable[[], AbstractContextManager[None]]  # FP32's TF32 switches (off on CUDA)
    autocast: Callable[[Format], AbstractContextManager[None]]  # a format's forward context
    backward_context: Callable[[Format], AbstractContextManager[None]]  # and its backward's
    loss: Callable[[], torch.Tensor]  # the model's forward on the batch, and its loss


class SessionState:
    """Names shared by the parts of a capture session (values set by ``CaptureSession.__init__``)."""

    config: Any  # a CaptureConfig (capture/session.py)
    model: torch.nn.Module
    layers: dict[int, LayerRecord]
    grad_all: MagnitudeHistogram
    reference: RunRecord | None
    runs: dict[Format, RunRecord]
    ranks: Ranks  # what an audit split over ranks changes (capture/ranks.py)

    _forward: Callable[[torch.nn.Module], Any]
    _loss_of: Callable[[Any], torch.Tensor]
    _names: dict[int, str]
    _modules: dict[int, torch.nn.Module]
    _phase: Format | str | None
    _use_gemm_mode: bool
    calls: CallStack
    _impacts_only: bool  # the second reduction order's repeat: loss impacts only (docs/performance.md)
    _call_ops: dict[tuple[int, int], tuple[int, int]]  # each call's op counts from the first pass
    _call_index: dict[int, int]
    _batch_tensors: dict[int, tuple[torch.Tensor, int]]
    _batch_call_records: dict[tuple[int, int], Any]  # (module, call) -> BatchCall (capture/reference_pass.py)
    _batch_sink: dict[str, dict[Format, float]] | None
    _on_reference_output: Callable[[Any, torch.Tensor], None] | None
    _grad_edges: list[Any]  # torch.autograd.graph.GradientEdge of each module output (the second order's backward)
    _out_hooks: OutputGradHooks  # dL/dy hooks of the current forward's module outputs (capture/output_grads.py)
    _views_rebased: bool  # the current forward changed a view output in place
    warnings: list[str]
    _user_autocast: UserAutocast  # the model's own autocast regions (capture/user_autocast.py)
    _grad_lost: Callable[[LayerRecord, int], None]
    _ref_outputs: dict[int, list[list[Kept]]]  # Kept: a tensor, or one in the store's file (reference_store.py)
    _ref_grad_nonfinite: dict[int, torch.Tensor]
    # each format's per-module figures as the reference pass left them (its re-runs' local errors and impacts),
    # put back before that format's pass runs again (capture/format_pass.py, forget_format_pass)
    _after_reference: dict[Format, dict[int, Any]]
    _draw_mismatches: int
    _pass_draw_mismatches: dict[Format, int]  # cuda mode: the draw mismatches of each format's latest pass
    _clone_cache: dict[int, tuple[weakref.ref, int, Kept]]
    _stat_cache: dict[tuple, tuple[weakref.ref, Any]]
    _producers: dict[tuple[int, int], tuple[Any, LayerRecord, int]]
    _loss_ref: Any
    _refs: ReferenceStore

    # the session's helpers (defined in capture/session.py)
    _reset: Callable[[], None]
    _run: Callable[[Format | None], tuple[Any, torch.Tensor]]
    _rng_state: Callable[[], RngState]
    _set_rng_state: Callable[[RngState], None]
    _autocast: Callable[[Format], AbstractContextManager[None]]
    _backward_context: Callable[..., AbstractContextManager[None]]  # (fmt: Format | None = None)
    _fp32_reference_switches: Callable[[], AbstractContextManager[None]]
    _same_draws: Callable[..., AbstractContextManager[None]]
    _hist_of: Callable[[torch.Tensor], MagnitudeHistogram]
    _summary_of: Callable[[torch.Tensor], RangeSummary]
    _error_of: Callable[[Kept, torch.Tensor], ErrorStats]
    _clone_ref: Callable[[torch.Tensor], Kept]
    _batch_call_output: Callable[..., Any]  # capture/reference_pass.py
    _batch_call_impacts: Callable[..., list[float]]
