"""The state and helpers that the parts of a capture session share, declared once.

:class:`~precision_audit.capture.session.CaptureSession` is assembled from parts (the reference pass in
reference_pass.py, the format passes in format_pass.py) and handed to collaborators (the step timer, timing.py;
the second reduction order, noise.py; an audit over ranks, ranks.py). What they share is declared here:
:class:`PassState`, the per-pass state the session owns (``session.state``), which every part and noise.py read and
write; :class:`StepControls`, what the timer and noise.py may do to the runs (``session.controls``); and
:class:`SessionState`, the names the mixed-in passes take from the session (values set in
``CaptureSession.__init__``, helpers defined there), for the type checker. No collaborator reads the session's
private names (tests/test_house_structure.py; docs/architecture.md, "capture/").
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..formats import Format
from ..host_rng import HostRng
from .calls import CallStack
from .output_grads import OutputGradHooks
from .ranks import Ranks
from .records import LayerRecord, RunRecord
from .reference_store import Kept, ReferenceStore
from .rerun_reuse import ChildReruns
from .stats import ErrorStats, MagnitudeHistogram, RangeSummary
from .user_autocast import UserAutocast

# torch's CPU generator, the device's CUDA generator (cuda mode), Python's and NumPy's (precision_audit/host_rng.py)
RngState = tuple[torch.Tensor, torch.Tensor | None, HostRng]


@dataclass
class PassState:
    """The per-pass state the parts of a capture session share: the session owns it (``session.state``) and its
    parts, the reference pass (capture/reference_pass.py), the format passes (capture/format_pass.py) and the
    second reduction order (capture/noise.py), read and write it here, never as the session's private names."""

    refs: ReferenceStore  # the reference's kept tensors: on the host on a GPU, in a file on a CPU (reference_store.py)
    phase: Format | str | None = None  # the pass running: "ref", a format, "profile" (timed steps), or None
    # The reference pass repeated at the second reduction order (capture/noise.py) is read for its loss impacts
    # only: it skips what only the first pass's records use (docs/performance.md, "Second order")
    impacts_only: bool = False
    # called with (output, loss) of the next FP32 forward: the second order's (capture/noise.py, _Fp32Order)
    on_reference_output: Callable[[Any, torch.Tensor], None] | None = None
    # the second order's format forwards (capture/noise.py): name -> format -> |loss impact| of calls on the batch
    batch_sink: dict[str, dict[Format, float]] | None = None
    # module -> per call, its FP32 outputs (Kept: a tensor, or one in the store's file), the format passes' reference
    ref_outputs: dict[int, list[list[Kept]]] = field(default_factory=dict)
    # parameter -> where its FP32 gradient is not finite (only parameters that have such positions): a format pass
    # is judged on the non-finite gradients it adds, not on FP32's own (docs/report.md)
    ref_grad_nonfinite: dict[int, torch.Tensor] = field(default_factory=dict)
    clone_cache: dict[int, tuple[weakref.ref, int, Kept]] = field(default_factory=dict)  # id -> its kept copy
    # Calls on the batch itself: (module, call) -> what the format passes need to measure the call's local error
    # (a BatchCall, capture/reference_pass.py)
    batch_call_records: dict[tuple[int, int], Any] = field(default_factory=dict)
    # the root call's tensor arguments with their versions: a call whose every tensor is one of them is on the batch
    batch_tensors: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    # the second order's backward: the gradient edges (torch.autograd.graph.GradientEdge) of the module outputs its
    # loss impacts read
    grad_edges: list[Any] = field(default_factory=list)
    # dL/dy hooks of the current forward's module outputs (capture/output_grads.py), and whether that forward changed
    # a view output in place
    out_hooks: OutputGradHooks = field(default_factory=OutputGradHooks)
    views_rebased: bool = False
    # (module, call) -> (own ops, own ops other than additions), from the first reference forward's op tracker: the
    # repeat at the second order runs the same ops and reads them from here, untracked
    call_ops: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    call_index: dict[int, int] = field(default_factory=dict)  # module -> its calls so far in this pass
    # each format's per-module figures as the reference pass left them (its re-runs' local errors and impacts), put
    # back before that format's pass runs again (capture/format_pass.py, forget_format_pass)
    after_reference: dict[Format, dict[int, Any]] = field(default_factory=dict)
    draw_mismatches: int = 0  # cuda mode: random draws the reference had no draw for (capture/rng_replay.py)
    pass_draw_mismatches: dict[Format, int] = field(default_factory=dict)  # those of each format's latest pass
    # reference pass: which module produced each output tensor (by identity and version), and the loss tensor
    # (weakly), so the FP16 loss scale can leave out dL/dL and count each gradient once (records.py)
    producers: dict[tuple[int, int], tuple[Any, LayerRecord, int]] = field(default_factory=dict)
    loss_ref: Any = None
    # reference pass: the re-run outputs of calls inside each running call, for that call's re-runs
    # (capture/rerun_reuse.py)
    child_reruns: ChildReruns = field(default_factory=ChildReruns)


@dataclass
class StepControls:
    """What the step timer (capture/timing.py) and the second reduction order (capture/noise.py) may do to the
    session's runs, handed over by the session (``session.controls``): they call these, read the call stack's names
    and the shared :class:`PassState`, and see nothing else of the session's own state."""

    calls: CallStack
    reset: Callable[[], None]  # every pass's fresh start (buffers, generators, caches)
    install_hooks: Callable[[], None]  # the session's module hooks, on
    remove_hooks: Callable[[], None]  # and off (the clean steps run without them)
    set_phase: Callable[[Format | str | None], None]  # "profile": the hooks time each module for the timer
    fp32_switches: Callable[[], AbstractContextManager[None]]  # FP32's TF32 switches (off on CUDA)
    autocast: Callable[[Format], AbstractContextManager[None]]  # a format's forward context
    backward_context: Callable[[Format], AbstractContextManager[None]]  # and its backward's
    loss: Callable[[], torch.Tensor]  # the model's forward on the batch, and its loss
    forward: Callable[[], Any]  # the model's forward on the batch (its output)
    loss_of: Callable[[Any], torch.Tensor]  # the loss of an output
    same_draws: Callable[[Format | None], AbstractContextManager[None]]  # cuda mode: the reference's random draws


class SessionState:
    """Names shared by the parts of a capture session (values set by ``CaptureSession.__init__``)."""

    config: Any  # a CaptureConfig (capture/session.py)
    model: torch.nn.Module
    layers: dict[int, LayerRecord]
    grad_all: MagnitudeHistogram
    reference: RunRecord | None
    runs: dict[Format, RunRecord]
    ranks: Ranks  # what an audit split over ranks changes (capture/ranks.py)
    state: PassState

    _forward: Callable[[torch.nn.Module], Any]
    _loss_of: Callable[[Any], torch.Tensor]
    _names: dict[int, str]
    _modules: dict[int, torch.nn.Module]
    _use_gemm_mode: bool
    calls: CallStack
    warnings: list[str]
    _user_autocast: UserAutocast  # the model's own autocast regions (capture/user_autocast.py)
    _grad_lost: Callable[[LayerRecord, int], None]
    _stat_cache: dict[tuple, tuple[weakref.ref, Any]]
    _pre_rng: list[Any]  # per call on the stack: its PreCall in the reference pass (capture/reference_pass.py)

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
