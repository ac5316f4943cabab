"""The capture session: the FP32 reference and one pass per low-precision format, forward and backward.

The passes run on the user's model in place, with no copy of it: the session keeps only what the passes change
(buffers, references to existing gradients, flags, hooks; see :class:`~.model_state.ModelState` and
docs/memory.md), resets the buffers before every run, seeds every run identically, and puts the model and the
global RNG state (every GPU's) back exactly when it ends, after a failure or a Ctrl-C too. Every format sees
the same dropout masks: in emulated mode the CPU kernels draw the same masks from the same seed whatever the
dtype; in cuda mode, where they do not, the reference pass's draws are recorded and replayed in the other
passes (capture/rng_replay.py).

The session is the thin part that ties the passes together: its module hooks keep the call stack and hand
each module call to the pass that is running. The passes live in their own modules:

- capture/reference_pass.py: the FP32 reference, each computing module re-run alone per format (local error);
- capture/format_pass.py: one pass per format (accumulated error), and the plan's verification forward;
- capture/timing.py: the clean, instrumented and (on request) profiled timed steps;
- capture/op_tracker.py: which ops each module runs itself, during the reference forward;
- capture/model_state.py: what the passes change on the model, and its exact restore.

Per module call the passes stream statistics, never keeping whole tensors per layer and format, except the
FP32 outputs of the reference pass, which the low-precision passes are compared against.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils._python_dispatch import _disable_current_modes

from .. import host_rng
from ..emulation import (
    KNOWN_GAPS,
    TF32_EMULATION,
    CudaAutocastPolicy,
    LowPrecisionGemmMode,
    Tf32GemmMode,
    emulated_autocast,
)
from ..errors import AuditError, ModelLoadError, ModelRunError
from ..formats import LOW_PRECISION_DTYPES, Format
from ..model_names import named_modules
from ..outputs import _NoInterrupt
from ..tf32_switches import tf32_switches
from .checkpointing import NonReentrantCheckpoints
from .compile_stance import force_eager
from .config import CaptureConfig
from .failures import RunFailure
from .format_pass import FormatPasses
from .memory import SavedTensorCounter
from .model_state import ModelState
from .op_tracker import OpTracker
from .output_grads import OutputGradHooks
from .ranks import GradHook, Ranks, tensor_key
from .records import CaptureResult, LayerRecord, RunRecord, float_tensors
from .reference_pass import ReferencePass, _tensors_in, pre_call
from .reference_store import Kept, ReferenceStore, release_free_heap
from .reseeds import ReproducibleReseeds
from .rng_replay import RandomDraws, recording, replaying
from .session_state import CallStack, PassState, RngState, StepControls
from .stats import ErrorStats, MagnitudeHistogram, RangeSummary
from .timing import StepTimer
from .user_autocast import UserAutocast

NO_GRAD_NOTE = ("no output gradient measured: its output does not require grad in the forward (computed under "
                "torch.no_grad(), from nothing that requires grad, or inside a custom autograd Function, as Hugging "
                "Face's Reformer runs its reversible layers), so its output-gradient figures are empty, not zero "
                "gradients")


class CaptureSession(ReferencePass, FormatPasses):
    """Runs the model on its batch in FP32 and in each format, and gathers per-module records.

    Example::

        with CaptureSession(model, run_forward, loss_of, CaptureConfig((Format.BF16,))) as s:
            s.reference_run()
            s.format_run(Format.BF16)
            result = s.result()
    """

    #: each forward's saved-tensor counter, until its pass is over: then its saved tensors are let go, so that a
    #: graph no backward freed goes too (capture/memory.py, _Saved)
    _counters: list[SavedTensorCounter]

    def __init__(
        self,
        model: torch.nn.Module,
        forward: Callable[[torch.nn.Module], Any],
        loss_of: Callable[[Any], torch.Tensor],
        config: CaptureConfig,
        progress: Callable[[str], None] | None = None,
        *,
        ranks: Ranks | None = None,
    ) -> None:
        self.config = config
        # what an audit split over ranks changes (capture/ranks.py); one process: nothing
        self.ranks = ranks if ranks is not None else Ranks()
        self._forward = forward
        self._loss_of = loss_of
        self._progress = progress or (lambda msg: None)
        # The passes run on the user's model itself, not on a copy; ModelState keeps what they change and puts
        # it back on exit, after a failure or a Ctrl-C too (docs/memory.md).
        self.model = model
        self._state = ModelState(model, config.device)
        self._prepared, self._reseeds = False, ReproducibleReseeds()  # torch.seed() in a forward (reseeds.py)
        self.training = model.training
        self._names = {id(m): n for n, m in named_modules(self.model)}
        self._modules = {id(m): m for _, m in named_modules(self.model)}
        # the module calls running now: the session's hooks push and pop them, the op tracker reads them
        self.calls = CallStack(self._names, self._modules, self._layer)
        # Passes never step an optimizer, so parameters do not change (checked, not copied); buffers do
        # (BatchNorm's running statistics), and are put back before every pass.
        self._param_versions: list[int] = []
        self.layers: dict[int, LayerRecord] = {}
        self.grad_all = MagnitudeHistogram()
        self.reference: RunRecord | None = None
        self.runs: dict[Format, RunRecord] = {}
        self.step_times: dict[str, list[float]] = {}
        self.memory: dict[str, dict[str, int]] = {}
        self.traces: dict[str, bytes] = {}
        self.warnings: list[str] = []
        # per-run state
        self._pre_rng: list[Any] = []
        self._draws = RandomDraws()  # cuda mode: the reference's random draws, replayed in the other passes
        # the per-pass state the session's parts share (capture/session_state.py); its references' store: on the
        # host on a GPU, in a temporary file on a CPU (reference_store.py)
        self.state = PassState(ReferenceStore(config.device))
        self.ranks.bind(self.calls, self.state.refs, self._grad_nonfinite)
        self._stat_cache: dict[tuple, tuple[weakref.ref, Any]] = {}  # per pass, weakly keyed by the tensors
        self._loss_scale = 1.0
        self._hooks: list[Any] = []
        self._exit = contextlib.ExitStack()
        self._policy: CudaAutocastPolicy | None = None
        self._gemm = LowPrecisionGemmMode()
        # The dispatch mode costs a Python call per op; it is switched on only when the model hits a CPU
        # kernel with no Half/BFloat16 implementation (then every later pass uses it).
        self._use_gemm_mode = False
        # what the step timer and the second order (capture/noise.py) may do to the runs
        self.controls = self._step_controls()
        self._timer, self._counters = StepTimer(self, self.controls), []

    def _step_controls(self) -> StepControls:
        """What the step timer and the second order may do to the runs (looked up at each call: an instance's own
        replacement counts)."""
        return StepControls(
            self.calls, reset=lambda: self._reset(), install_hooks=lambda: self._install_hooks(),
            remove_hooks=lambda: self._remove_hooks(), set_phase=lambda p: setattr(self.state, "phase", p),
            fp32_switches=lambda: self._fp32_reference_switches(), autocast=lambda f: self._autocast(f),
            backward_context=lambda f: self._backward_context(f),
            loss=lambda: self._loss_of(self._forward(self.model)), forward=lambda: self._forward(self.model),
            loss_of=lambda out: self._loss_of(out), same_draws=lambda p: self._same_draws(p))

    # -- context -------------------------------------------------------------------------------------
    def __enter__(self) -> CaptureSession:
        es = self._exit
        try:
            # every GPU's generator is restored (manual_seed_all in _reset reseeds them all), not only device
            # 0's; in emulated mode too when CUDA is already in use in this process
            cuda = self.config.mode == "cuda" or (torch.cuda.is_available() and torch.cuda.is_initialized())
            devices = list(range(torch.cuda.device_count())) if cuda else []
            es.enter_context(torch.random.fork_rng(devices=devices))
            es.enter_context(host_rng.fork())
            es.enter_context(self._reseeds)
            self._prepared = True
            self._state.prepare()
            self._param_versions = [p._version for p in self.model.parameters()]
            if self.config.mode == "emulated":
                self._policy = es.enter_context(CudaAutocastPolicy(self.config.kernels))
            self._user_autocast = es.enter_context(UserAutocast(self.config.mode == "emulated"))
            es.enter_context(NonReentrantCheckpoints())
            # torch.compile'd submodules run their eager code, which the hooks and the emulation see op by op
            es.enter_context(force_eager())
            self._install_hooks()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _install_hooks(self) -> None:
        if isinstance(self.model, torch.jit.ScriptModule):
            raise ModelLoadError("the model is a TorchScript module, whose layers cannot be hooked one by one",
                                 found=f"{type(self.model).__name__} (torch.jit.script or torch.jit.trace)",
                                 hint="audit the eager nn.Module you script (a scripted submodule inside an eager "
                                      "model is fine: it is measured as part of its parent)")
        for m in self._modules.values():  # a torch.compile wrapper inside the model is transparent (its module's are)
            if isinstance(m, torch.jit.ScriptModule):
                # TorchScript modules take no Python hooks; their ops count as their eager parent's own work
                continue
            self._hooks.append(m.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            self._hooks.append(m.register_forward_hook(self._post_hook, with_kwargs=True))

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def __exit__(self, *exc: object) -> None:
        # A Ctrl-C during the restore is held back until the model is back (precision_audit/outputs.py).
        with _NoInterrupt():
            try:
                self._remove_hooks()
                self.state.ref_outputs.clear()
                self.state.clone_cache.clear()
                self._stat_cache.clear()
                self.state.producers.clear()
                self._draws.clear()
                self.state.call_ops.clear()
                self.state.batch_call_records.clear()  # their FP32 outputs are in the store: released with it
                self._release_saved()
                self.state.refs.close()
            finally:
                try:
                    if self._prepared:
                        self._state.restore()
                        self._prepared = False
                finally:
                    self._exit.close()

    # -- helpers -------------------------------------------------------------------------------------
    def _release_saved(self) -> None:
        for c in self._counters:
            c.release_saved()
        self._counters.clear()

    def _reset(self) -> None:
        self._release_saved()  # the last pass's backward has run
        self._state.reset_buffers()
        if [p._version for p in self.model.parameters()] != self._param_versions:
            raise ModelRunError("the model changed its own parameters in place during a forward pass, so passes "
                                "in different formats would not start from the same weights",
                                hint="audit a model whose forward does not modify its parameters (the write "
                                     "happened after the FP32 pass, which refuses such writes; the audit keeps "
                                     "no copy of the parameters, see docs/memory.md)")
        for p in self.model.parameters():
            p.grad = None
        torch.manual_seed(self.config.seed)
        if self.config.mode == "cuda":
            torch.cuda.manual_seed_all(self.config.seed)
        host_rng.seed(self.config.seed)  # np.random / random in the model's forward draw alike in every pass
        self.calls.stack.clear()
        self.calls.own_ops.clear()
        self.calls.own_work.clear()
        self._pre_rng.clear()
        self.state.call_index.clear()
        self._stat_cache.clear()
        self.state.producers.clear()
        self.state.loss_ref = None
        release_free_heap()  # the last pass's freed activations, back to the system (capture/reference_store.py)
        self.ranks.reset()

    def _rng_state(self) -> RngState:
        cuda = torch.cuda.get_rng_state(self.config.device) if self.config.mode == "cuda" else None
        return torch.get_rng_state(), cuda, host_rng.state()

    def _set_rng_state(self, state: RngState) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.config.device)
        host_rng.set_state(state[2])

    @contextlib.contextmanager
    def _autocast(self, fmt: Format) -> Iterator[None]:
        if fmt is Format.TF32:  # no autocast: fp32 with TF32 GEMMs (docs/emulation.md, "TF32")
            with self._tf32():
                yield
            return
        dtype = LOW_PRECISION_DTYPES[fmt]
        if self.config.mode == "cuda":
            # TF32 off, as in the FP32 reference and its local re-runs: what autocast leaves in fp32 is strict fp32
            # in every pass, as the emulation computes it (docs/gpu.md, "TF32 switches")
            with tf32_switches(matmul=False, cudnn=False), torch.autocast("cuda", dtype=dtype):
                yield
        else:
            with emulated_autocast(dtype, self._gemm if self._use_gemm_mode else None):
                yield

    @contextlib.contextmanager
    def _tf32(self) -> Iterator[None]:
        """The TF32 pass's numerics: on CUDA both TF32 switches on (cuBLAS and cuDNN), the user's exact settings
        restored after; emulated, :class:`Tf32GemmMode` rounds every fp32 GEMM's operands to TF32."""
        if self.config.mode == "cuda":
            with tf32_switches(matmul=True, cudnn=True):
                yield
        else:
            with Tf32GemmMode():
                yield

    @contextlib.contextmanager
    def _backward_context(self, fmt: Format | None = None) -> Iterator[None]:
        """The backward of a ``fmt`` pass: TF32's gradient GEMMs on TF32 too, fp16/bf16's with TF32 off on CUDA;
        emulated fp16/bf16 under the fp32-fallback dispatch mode once it is on."""
        if fmt is Format.TF32:
            with self._tf32():
                yield
        elif self.config.mode == "cuda":  # TF32 off, as in the forward (_autocast)
            with tf32_switches(matmul=False, cudnn=False):
                yield
        elif self.config.mode == "emulated" and self._use_gemm_mode:
            with self._gemm:
                yield
        else:
            yield

    @contextlib.contextmanager
    def _fp32_reference_switches(self) -> Iterator[None]:
        """TF32 off for the FP32 reference on CUDA (cuBLAS and cuDNN); the user's exact settings are restored
        afterwards, through the API they were made with (precision_audit/tf32_switches.py)."""
        if self.config.mode != "cuda":
            yield
            return
        with tf32_switches(matmul=False, cudnn=False):
            yield

    @contextlib.contextmanager
    def _same_draws(self, phase: Format | None, start: int = 0) -> Iterator[None]:
        """CUDA only: the reference pass records its random draws (dropout masks), the other passes replay
        them from position ``start``, so that every format sees the same masks (capture/rng_replay.py)."""
        if self.config.mode != "cuda":
            yield
            return
        if phase is None:
            self._draws.clear()
            with recording(self._draws):
                yield
            return
        with replaying(self._draws, start) as r:
            try:
                yield
            finally:
                self.state.draw_mismatches += r.mismatches

    def _draw_warnings(self) -> list[str]:
        if not self.state.draw_mismatches:
            return []
        return [f"{self.state.draw_mismatches} random draw(s) in the low-precision passes (counted per pass and "
                "re-run) had no draw of the same shape at the same position in the FP32 reference and were drawn anew: "
                "their dropout masks (or noise) "
                "differ from the reference's, so the errors of the modules after them include that difference"]

    def _layer(self, m: torch.nn.Module) -> LayerRecord:
        rec = self.layers.get(id(m))
        if rec is None:
            name = self._names.get(id(m), "?")
            rec = LayerRecord(
                name=name,
                type=type(m).__name__,
                depth=0 if name == "" else name.count(".") + 1,
                is_leaf=next(iter(m.children()), None) is None,
                param_count=sum(p.numel() for p in m.parameters(recurse=False)),
                total_param_count=sum(p.numel() for p in m.parameters()),
                order=len(self.layers),
            )
            self.layers[id(m)] = rec
        return rec

    # A module's output is often its parent's too (a Sequential returns its last child's output): statistics of
    # one tensor are computed once per pass and merged into every record that sees it.
    def _cached(self, kind: str, tensors: tuple[Kept, ...], make: Callable[[], Any],
                operands: Callable[[], tuple[torch.Tensor, ...]] | None = None) -> Any:
        """``make()``'s statistics object for these tensors, computed once per pass (from ``operands()`` when
        given: the same values, where the statistic reads them)."""
        # a tensor every rank holds alike is counted on one (capture/ranks.py); asked on every rank, in every pass
        if self.state.phase is not None and not self.ranks.counted_here(
                tensors[-1], lambda: f"a {kind} statistic of {self._where()}"):
            return make()
        key = (kind, *(tensor_key(t) for t in tensors))
        hit = self._stat_cache.get(key)
        if hit is None or hit[0]() is not tensors[-1]:
            stats = make()
            stats.update(*(operands() if operands is not None else tensors))
            # a weak reference: holding the tensor would keep every module output of the pass alive until its
            # end, activations a training step frees as it goes (a dead one is a miss: its id may be reused)
            hit = self._stat_cache[key] = (weakref.ref(tensors[-1]), stats)
        return hit[1]

    def _where(self) -> str:
        """The module call running now, for a message."""
        return f"'{self._names.get(self.calls.stack[-1], '?') or '(root)'}'" if self.calls.stack else "the model"

    def _hist_of(self, t: torch.Tensor) -> MagnitudeHistogram:
        return self._cached("hist", (t,), MagnitudeHistogram)

    def _summary_of(self, t: torch.Tensor) -> RangeSummary:
        return self._cached("sum", (t,), RangeSummary)

    def _error_of(self, r: Kept, y: torch.Tensor) -> ErrorStats:
        # r, the reference's output, may be on the host (capture/reference_store.py): compared on y's device
        return self._cached("err", (r, y), ErrorStats, lambda: (self.state.refs.for_stats(r, y), y))

    def _clone_ref(self, t: torch.Tensor) -> Kept:
        # the same tensor (a weak reference: once it is freed, its id may be another tensor's), unchanged since
        hit = self.state.clone_cache.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit[2]
        c = self.state.refs.keep(t)
        self.state.clone_cache[id(t)] = (weakref.ref(t), t._version, c)
        return c

    # -- hooks ---------------------------------------------------------------------------------------
    def _pre_hook(self, m: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.state.phase == "profile":
            self._timer.pre(m)
            return
        if self.state.phase is None or self.calls.rerunning:
            return
        self.ranks.module_called(self._names.get(id(m), "?") or "(root)")
        with _disable_current_modes():  # our bookkeeping is neither the model's ops nor worth tracking
            self.calls.stack.append(id(m))
            self.calls.own_ops.append(0)
            self.calls.own_work.append(0)
            if self.state.phase == "ref":
                if m is self.model:  # the batch as the model is given it (calls on it: BatchCall)
                    self.state.batch_tensors = {id(t): (t, t._version) for t in _tensors_in((args, kwargs))}
                self._pre_rng.append(pre_call(self._rng_state(), m, args, kwargs, len(self._draws),
                                              self._user_autocast.innermost))
                self._layer(m)  # records are ordered by first call (pre-order of execution)
                self._note_consumer(m, args, kwargs)
            else:  # a format pass: the random state before a call on the batch, to check it is the FP32 pass's
                key = (id(m), self.state.call_index.get(id(m), 0))
                self._pre_rng.append(self._rng_state() if key in self.state.batch_call_records else None)

    def _post_hook(self, m: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.state.phase == "profile":
            self._timer.post(m)
            return
        if self.state.phase is None or self.calls.rerunning:
            return
        if not self.calls.stack or self.calls.stack[-1] != id(m):
            return  # a hook registered mid-call; ignore
        # The statistics below run tensor ops; the op tracker must not see them (they are not the model's
        # work, and would make a parent module look as if it computed something itself).
        with _disable_current_modes():
            self._post_hook_body(m, args, kwargs, output)

    def _post_hook_body(self, m: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.calls.stack.pop()
        own_ops = self.calls.own_ops.pop()
        own_work = self.calls.own_work.pop()
        pre_rng = self._pre_rng.pop()
        ys = float_tensors(output)
        self.ranks.outputs(self._names.get(id(m), "?") or "(root)", ys)
        if self.state.batch_sink is not None:  # the second order's format forward: calls on the batch only
            self._post_batch_only(m, args, kwargs, pre_rng, ys)
            return
        rec = self._layer(m)
        diffs: dict[Format, list[Kept]] = {}
        if self.state.phase == "ref":
            diffs = self._post_reference(m, rec, args, kwargs, ys, own_ops, pre_rng, own_work)
        else:
            self._post_format(m, rec, ys, args, kwargs, pre_rng)
        for i, y in enumerate(ys):
            own = self.state.phase == "ref" and self._note_producer(rec, i, y)
            if y.requires_grad:
                hook = self._grad_hook(rec, {f: d[i] for f, d in diffs.items()}, (i, weakref.ref(y)) if own else None)
                self.state.out_hooks.register(y, hook, functools.partial(self._grad_lost, rec, i))
                if self.state.impacts_only:  # the gradients the second order's backward computes (_reference_backward)
                    self.state.grad_edges.append(get_gradient_edge(y))
        if self.state.phase == "ref" and ys and not any(y.requires_grad for y in ys) and NO_GRAD_NOTE not in rec.notes:
            rec.notes.append(NO_GRAD_NOTE)

    # -- runs ----------------------------------------------------------------------------------------
    def _run(self, fmt: Format | None) -> tuple[Any, torch.Tensor]:
        """One forward (under autocast for a format) and the loss; errors name the module that raised."""
        counter = SavedTensorCounter(self.model, lambda: self.calls.stack[-1] if self.calls.stack else None)
        self._counters.append(counter)
        self.state.out_hooks = OutputGradHooks()
        try:
            if fmt is None:
                # the repeat at the second order reads the first pass's per-call op counts (state.call_ops)
                tracker = contextlib.nullcontext() if self.state.impacts_only else OpTracker(self.calls, self.model)
                with self._fp32_reference_switches(), counter, self._same_draws(None), tracker:
                    out = self._forward(self.model)
                    loss = self._loss_of(out)
                self.state.loss_ref = weakref.ref(loss)
            else:
                with counter, self._autocast(fmt), self._same_draws(fmt):
                    out = self._forward(self.model)
                    loss = self._loss_of(out)
            # outputs changed in place (capture/output_grads.py)
            self.state.views_rebased = self.state.out_hooks.settle(loss)
            key = "fp32" if fmt is None else fmt.value
            self.memory[key] = {"activation_bytes": counter.tally.activation_bytes,
                                "weight_copy_bytes": counter.tally.weight_copy_bytes}
            for mid, nbytes in counter.tally.by_module.items():
                self._layer(self._modules[mid]).saved_bytes[key] = nbytes
        except (torch.OutOfMemoryError, AuditError):
            # the user's own errors (a loss_fn returning a vector) and OOM (cli/main.py advises a smaller batch)
            # pass as is
            self.calls.stack.clear()
            raise
        except Exception as e:
            where = self._names.get(self.calls.stack[-1], "?") if self.calls.stack else None
            self.calls.stack.clear()
            raise RunFailure(e, where) from e
        return out, loss

    def _grad_hook(self, rec: LayerRecord, diffs: dict[Format, Kept] | None = None,
                   own: tuple[int, Any] | None = None) -> GradHook:
        """The hook of one of ``rec``'s outputs, as the ranks make it (capture/ranks.py) from :meth:`_own_grad_hook`."""
        return self.ranks.grad_hook(rec, diffs, own, self._own_grad_hook)

    def _own_grad_hook(self, rec: LayerRecord, diffs: dict[Format, Kept] | None = None,
                       own: tuple[int, Any] | None = None) -> GradHook:
        """``own``: (slot, weak reference to the tensor) when ``rec`` produced it (reference pass)."""
        phase = self.state.phase

        def hook(g: torch.Tensor) -> None:
            if g is None:
                return
            if phase == "ref":
                self._reference_grad(rec, g, diffs, own)
            elif isinstance(phase, Format):
                rec.formats[phase].grad_output.update(g)
        return hook

    def _grad_lost(self, rec: LayerRecord, slot: int) -> None:
        where = f"the {self.state.phase.value} pass" if isinstance(self.state.phase, Format) else "the FP32 pass"
        note = (f"dL/dy of output {slot} not measured in {where}: the output is a view of part of a larger tensor "
                "and a later op changed it in place, so autograd keeps no gradient of the value the module "
                "returned; its gradient ranges and loss impacts leave that call out")
        if note not in rec.notes:
            rec.notes.append(note)

    def timed_steps(self, steps: int, traces: bool = False) -> dict[str, list[float]]:
        """Per format, ``steps`` clean steps, then ``steps`` instrumented ones; with ``traces``, ``steps``
        profiled ones per format for the traces (capture/timing.py)."""
        return self._timer.run(steps, traces)

    def result(self) -> CaptureResult:
        assert self.reference is not None, "reference_run() first"
        layers = sorted(self.layers.values(), key=lambda r: r.order)
        emulation = None
        if self._policy is not None:
            emulation = {
                "autocast_policy": "CUDA autocast op table, torch 2.13 (aten/src/ATen/autocast_mode.h)",
                "unknown_cuda_autocast_ops": list(self._policy.unknown_ops),
                "table_ops_not_registered": list(self._policy.stale_ops),
                "gemm_ops": "computed in fp32 from rounded inputs, rounded once (in the autocast kernels)",
                "kernels": self._policy.kernels,
                "dispatch_mode_used": self._use_gemm_mode,
                "fp32_fallback_ops": sorted(self._gemm.fallback_ops),
                "known_gaps": list(KNOWN_GAPS),
            }
            if Format.TF32 in self.config.formats:  # only then: a default audit's audit.json stays as it was
                emulation["tf32"] = copy.deepcopy(TF32_EMULATION)
        return CaptureResult(
            mode=self.config.mode,
            device=self.config.device,
            formats=self.config.formats,
            training=self.training,
            layers=layers,
            reference=self.reference,
            runs=dict(self.runs),
            grad_all=self.grad_all,
            step_times_s=dict(self.step_times),
            emulation=emulation,
            warnings=list(self.warnings) + self._draw_warnings()
            + ([self.state.refs.note] if self.state.refs.note else []) + self._reseeds.warning(),
            memory=dict(self.memory),
            traces=dict(self.traces),
            outside_ops=self.calls.outside_ops,
        )

