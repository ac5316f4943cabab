"""The capture runs: an FP32 reference and one pass per low-precision format, forward and backward.

The passes run on the user's model in place, with no copy of it: the session keeps only what the passes change
(buffers, references to existing gradients, flags, hooks; see :class:`ModelState` and docs/memory.md), resets
the buffers before every run, seeds every run identically, and puts the model and the global RNG state (every
GPU's) back exactly when it ends, after a failure or a Ctrl-C too. Every format sees the same dropout masks: in emulated mode the CPU kernels draw the same
masks from the same seed whatever the dtype; in cuda mode, where they do not, the reference pass's draws
are recorded and replayed in the other passes (capture/rng_replay.py).

Per module call it streams statistics (never keeping whole tensors per layer and format, except the FP32
outputs of the reference pass, which the low-precision passes are compared against):

- reference pass: output magnitudes, dL/dy and dL/dW histograms, and the *local* error: each module that
  computes is re-run alone under each format on its exact FP32 inputs;
- format passes: the *accumulated* error of each output against the reference, the outputs' and
  gradients' actual magnitudes and non-finite counts.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..distributed.tensors import local_tensor, owned_part
from ..errors import AuditError, ModelRunError, NumericsError
from ..formats import LOW_PRECISION_DTYPES, Format
from ..outputs import _NoInterrupt
from ..tf32_switches import tf32_switches
from .memory import SavedTensorCounter
from .rng_replay import RandomDraws, recording, replaying
from .ops import record_op
from .emulation import (KNOWN_GAPS, CudaAutocastPolicy, LowPrecisionGemmMode, emulated_autocast,
                        is_missing_low_precision_kernel, rounding_registry_paused)
from .records import CaptureResult, FormatLayerStats, LayerRecord, RunRecord, float_tensors
from .stats import ErrorStats, MagnitudeHistogram, RangeSummary

log = logging.getLogger(__name__)

_aten = torch.ops.aten
# Ops that move or relabel data without computing: they do not make a module "compute".
_NON_COMPUTE = {
    _aten.detach.default, _aten.alias.default, _aten.clone.default, _aten._to_copy.default, _aten.copy_.default,
    _aten.empty_like.default, _aten.zeros_like.default, _aten.ones_like.default, _aten.new_empty.default,
    _aten.new_zeros.default, _aten.new_ones.default, _aten.lift_fresh.default, _aten._unsafe_view.default,
    _aten.empty.memory_format, _aten.zeros.default, _aten.ones.default, _aten.arange.start, _aten.arange.default,
    _aten.arange.start_step, _aten.full.default, _aten.scalar_tensor.default,
}


@dataclass(frozen=True)
class CaptureConfig:
    """How to run the capture.

    ``mode`` is ``"cuda"`` (real ``torch.autocast("cuda")``) or ``"emulated"`` (CUDA autocast's policy and
    Tensor Core rounding computed on any device). ``loss_scales`` maps a format to the loss scale its
    backward uses (FP16 needs one; BF16 does not).
    """

    formats: tuple[Format, ...]
    device: str = "cpu"
    mode: str = "emulated"
    seed: int = 0
    timed_steps: int = 1
    kernels: str = "python"  # emulated mode: "python" or "compiled" (see capture/compiled.py)

    def __post_init__(self) -> None:
        if self.mode not in ("cuda", "emulated"):
            raise ValueError(f"mode must be 'cuda' or 'emulated', got {self.mode!r}")
        if self.mode == "cuda" and not self.device.startswith("cuda"):
            raise ValueError("mode 'cuda' needs a cuda device")
        for f in self.formats:
            if f not in LOW_PRECISION_DTYPES:
                raise ValueError(f"format {f} cannot be captured (capturable: fp16, bf16)")
        if self.timed_steps < 0:
            raise ValueError("timed_steps must be >= 0")


#: Module attributes holding hook dictionaries: their *contents* are put back (no hook left behind, the user's
#: own hooks kept in their order), whatever the passes or the model's forward added or removed.
def _is_hook_dict(name: str, value: Any) -> bool:
    return "hooks" in name and isinstance(value, dict)


class ModelState:
    """Everything a capture session changes on the user's model, kept to put it back exactly (docs/memory.md).

    The audit runs on the user's model in place, not on a copy. What is kept is only what the passes change:

    - a clone of every buffer (BatchNorm's running statistics move in train mode; buffers are small next to
      the parameters), copied back before every pass and at the end;
    - parameters are never copied: the passes do not write them (the reference pass refuses an in-place write to
      a parameter before it happens, see ``_OpTracker``). When the model must move to the audit's device, the
      original ``.data`` of each parameter and the original buffer objects are held and put back, storage and all;
    - references to the existing ``.grad`` tensors (not copies; ``None`` stays ``None``), ``requires_grad`` per
      parameter, ``.training`` per module, each module's attributes (rebound ones are put back, added ones
      removed) and the contents of its hook dictionaries;
    - the RNG states are forked by the session itself (CPU and every CUDA device).
    """

    def __init__(self, model: torch.nn.Module, device: str) -> None:
        self.model = model
        self.device = torch.device(device)
        self.modules = list(model.modules())
        self._dicts: list[tuple[torch.nn.Module, dict[str, Any], dict[str, dict]]] = []
        for m in self.modules:
            attrs = dict(m.__dict__)
            inner = {k: dict(v) for k, v in attrs.items()
                     if k in ("_parameters", "_buffers", "_modules") or _is_hook_dict(k, v)}
            self._dicts.append((m, attrs, inner))
        seen: set[int] = set()
        self._params: list[tuple[torch.nn.Parameter, torch.Tensor, bool, torch.Tensor | None]] = []
        for p in model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                self._params.append((p, p.data, p.requires_grad, p.grad))
        self._buffers: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
        seen.clear()
        for m in self.modules:
            for name, b in m._buffers.items():
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    self._buffers.append((m, name, b))
        self.moved = any(t.device != self.device for t in model.parameters()) or \
            any(b.device != self.device for _, _, b in self._buffers)
        # buffers: owner, name, the tensor the passes use, and the value to reset it to
        self._live: list[tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]] = []

    def prepare(self) -> None:
        """Detach the user's gradients, move to the audit's device if needed, and snapshot the buffers."""
        for p, _, _, _ in self._params:
            p.grad = None
        if self.moved:
            # the originals stay untouched where they are: they are the snapshot (no clone on their device)
            with torch.no_grad():
                self.model.to(self.device)
        with torch.no_grad():
            for m, name, orig in self._buffers:
                live = m._buffers.get(name)
                if live is None:
                    continue
                snap = orig if live is not orig else orig.detach().clone()
                self._live.append((m, name, live, snap))

    def reset_buffers(self) -> None:
        """Put every buffer back to its value when the audit started. Every buffer is copied: a kernel may
        write one without bumping its version (CPU batch_norm's running statistics), so versions cannot tell. A
        buffer the forward rebound (``self.count = self.count + 1``) is put back as the object it was."""
        with torch.no_grad():
            for m, name, live, snap in self._live:
                if m._buffers.get(name) is not live:
                    m._buffers[name] = live
                live.copy_(snap)

    def restore(self) -> None:
        """Put the model back as it was given; safe to call after a failure at any point, and more than once."""
        with torch.no_grad():
            if not self.moved:  # moved: the original buffers were never touched and are put back below
                self.reset_buffers()
            for m, attrs, inner in self._dicts:
                d = m.__dict__
                for k in [k for k in d if k not in attrs]:
                    del d[k]
                for k, v in attrs.items():
                    if d.get(k, _MISSING) is not v:
                        d[k] = v
                for k, saved in inner.items():
                    live = d[k]
                    live.clear()
                    live.update(saved)
            for p, data, requires_grad, grad in self._params:
                if self.moved:
                    p.data = data
                p.grad = grad
                if p.requires_grad != requires_grad:
                    p.requires_grad_(requires_grad)


_MISSING = object()


class _OpTracker(TorchDispatchMode):
    """Counts compute ops per innermost module during the reference forward."""

    def __init__(self, session: "CaptureSession") -> None:
        super().__init__()
        self.session = session

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        s = self.session
        written = _written_args(func)
        if written and not s._rerunning:
            s._refuse_parameter_write(func, written, args, kwargs)
        out = func(*args, **kwargs)
        if not s._rerunning and s._stack and not func.is_view and func not in _NON_COMPUTE:
            s._own_ops[-1] += 1
            if func not in _ADDS:
                s._own_work[-1] += 1
            record_op(s._layer(s._modules[s._stack[-1]]).ops, func, args, kwargs, out)
        return out

# A module's own ops that still leave it a container (not re-run alone): additions (a residual add).
_ADDS = {_aten.add.Tensor, _aten.add_.Tensor, _aten.add.Scalar, _aten.add_.Scalar}
CONTAINER_NOTE = ("not re-run: container (its own work is only additions; its children's local errors are "
                  "measured)")

_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}


def _written_args(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments ``func`` writes in place (from its schema; cached per op)."""
    hit = _WRITTEN.get(func)
    if hit is None:
        hit = _WRITTEN[func] = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                                     if a.alias_info is not None and a.alias_info.is_write)
    return hit


class CaptureSession:
    """Runs the model on its batch in FP32 and in each format, and gathers per-module records.

    Example::

        with CaptureSession(model, run_forward, loss_of, CaptureConfig((Format.BF16,))) as s:
            s.reference_run()
            s.format_run(Format.BF16)
            result = s.result()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        forward: Callable[[torch.nn.Module], Any],
        loss_of: Callable[[Any], torch.Tensor],
        config: CaptureConfig,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self._forward = forward
        self._loss_of = loss_of
        self._progress = progress or (lambda msg: None)
        # The passes run on the user's model itself, not on a copy; ModelState keeps what they change and puts
        # it back on exit, after a failure or a Ctrl-C too (docs/memory.md).
        self.model = model
        self._state = ModelState(model, config.device)
        self._prepared = False
        self.training = model.training
        self._names = {id(m): n for n, m in self.model.named_modules()}
        self._modules = {id(m): m for _, m in self.model.named_modules()}
        # Passes never step an optimizer, so parameters do not change (checked, not copied); buffers do
        # (BatchNorm's running statistics), and are put back before every pass.
        self._param_versions: list[int] = []
        self._param_ptrs: set[int] = set()
        self.layers: dict[int, LayerRecord] = {}
        self.grad_all = MagnitudeHistogram()
        self.reference: RunRecord | None = None
        self.runs: dict[Format, RunRecord] = {}
        # parameter -> where its FP32 gradient is not finite (only parameters that have such positions): a format
        # pass is judged on the non-finite gradients it adds, not on FP32's own (README.md, audit.json)
        self._ref_grad_nonfinite: dict[int, torch.Tensor] = {}
        self.step_times: dict[str, list[float]] = {}
        self.memory: dict[str, dict[str, int]] = {}
        self._prof_stack: list[tuple[int, Any, Any]] = []
        self._pending_events: list[tuple[int, Any, Any]] = []
        self._step_layer_times: dict[int, float] = {}
        self._layer_times: dict[int, list[float]] = {}
        self.traces: dict[str, bytes] = {}
        self.warnings: list[str] = []
        # per-run state
        self._phase: Format | str | None = None
        self._stack: list[int] = []
        self._own_ops: list[int] = []
        self._own_work: list[int] = []  # per call on the stack: its own ops other than additions (_ADDS)
        self._pre_rng: list[Any] = []
        self._draws = RandomDraws()  # cuda mode: the reference's random draws, replayed in the other passes
        self._draw_mismatches = 0
        self._rerunning = False
        self._call_index: dict[int, int] = {}
        self._ref_outputs: dict[int, list[list[torch.Tensor]]] = {}
        self._clone_cache: dict[int, tuple[int, torch.Tensor]] = {}
        self._stat_cache: dict[tuple, tuple[torch.Tensor, Any]] = {}  # per pass; holds the tensors it keys
        self._loss_scale = 1.0
        # reference pass: which module produced each output tensor (by identity and version), and the loss
        # tensor, so the FP16 loss scale can leave out dL/dL and count each gradient once (records.py)
        self._producers: dict[tuple[int, int], tuple[Any, LayerRecord, int]] = {}
        self._loss_ref: Any = None
        self._hooks: list[Any] = []
        self._exit = contextlib.ExitStack()
        self._policy: CudaAutocastPolicy | None = None
        self._gemm = LowPrecisionGemmMode()
        # The dispatch mode costs a Python call per op; it is switched on only when the model hits a CPU
        # kernel with no Half/BFloat16 implementation (then every later pass uses it).
        self._use_gemm_mode = False

    # -- context -------------------------------------------------------------------------------------
    def __enter__(self) -> "CaptureSession":
        es = self._exit
        try:
            # every GPU's generator is restored (manual_seed_all in _reset reseeds them all), not only device
            # 0's; in emulated mode too when CUDA is already in use in this process
            cuda = self.config.mode == "cuda" or (torch.cuda.is_available() and torch.cuda.is_initialized())
            devices = list(range(torch.cuda.device_count())) if cuda else []
            es.enter_context(torch.random.fork_rng(devices=devices))
            self._prepared = True
            self._state.prepare()
            self._param_versions = [p._version for p in self.model.parameters()]
            self._param_ptrs = {local_tensor(p).untyped_storage().data_ptr() for p in self.model.parameters()}
            if self.config.mode == "emulated":
                self._policy = es.enter_context(CudaAutocastPolicy(self.config.kernels))
            self._install_hooks()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _install_hooks(self) -> None:
        for m in self.model.modules():
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
                self._ref_outputs.clear()
                self._clone_cache.clear()
                self._stat_cache.clear()
                self._producers.clear()
                self._draws.clear()
            finally:
                try:
                    if self._prepared:
                        self._state.restore()
                        self._prepared = False
                finally:
                    self._exit.close()

    def _refuse_parameter_write(self, func: Any, written: tuple[tuple[int, str], ...], args: tuple,
                                kwargs: dict) -> None:
        """Raise before an op writes into a parameter: the audit runs on the user's model and does not copy
        its parameters, so the write must not happen (docs/memory.md)."""
        for i, name in written:
            t = args[i] if i < len(args) else kwargs.get(name)
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self._param_ptrs:
                where = self._names.get(self._stack[-1], "?") if self._stack else None
                raise ModelRunError(
                    f"the model writes into its own parameters during the forward pass ({func}), so passes in "
                    "different formats would not start from the same weights",
                    found=f"in module '{where or '(model)'}'" if where is not None else None,
                    hint="audit a model whose forward does not modify its parameters; the write was refused "
                         "before it happened, so the model is unchanged")

    # -- helpers -------------------------------------------------------------------------------------
    def _reset(self) -> None:
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
        self._stack.clear()
        self._own_ops.clear()
        self._own_work.clear()
        self._pre_rng.clear()
        self._call_index.clear()
        self._stat_cache.clear()
        self._producers.clear()
        self._loss_ref = None

    def _rng_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        cuda = torch.cuda.get_rng_state(self.config.device) if self.config.mode == "cuda" else None
        return torch.get_rng_state(), cuda

    def _set_rng_state(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.config.device)

    @contextlib.contextmanager
    def _autocast(self, fmt: Format) -> Iterator[None]:
        dtype = LOW_PRECISION_DTYPES[fmt]
        if self.config.mode == "cuda":
            with torch.autocast("cuda", dtype=dtype):
                yield
        else:
            with emulated_autocast(dtype, self._gemm if self._use_gemm_mode else None):
                yield

    @contextlib.contextmanager
    def _backward_context(self) -> Iterator[None]:
        if self.config.mode == "emulated" and self._use_gemm_mode:
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
                self._draw_mismatches += r.mismatches

    def _draw_warnings(self) -> list[str]:
        if not self._draw_mismatches:
            return []
        return [f"{self._draw_mismatches} random draw(s) in the low-precision passes (counted per pass and re-run) "
                "had no draw of the same shape at the same position in the FP32 reference and were drawn anew: "
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
    @staticmethod
    def _tensor_key(t: torch.Tensor) -> tuple:
        return (id(t), t._version, t.data_ptr(), tuple(t.shape), t.dtype)

    def _cached(self, kind: str, tensors: tuple[torch.Tensor, ...], make: Callable[[], Any]) -> Any:
        """``make()``'s statistics object for these tensors, computed once per pass."""
        key = (kind, *(self._tensor_key(t) for t in tensors))
        hit = self._stat_cache.get(key)
        if hit is None or hit[0] is not tensors[-1]:
            stats = make()
            stats.update(*tensors)
            hit = self._stat_cache[key] = (tensors[-1], stats)
        return hit[1]

    def _hist_of(self, t: torch.Tensor) -> MagnitudeHistogram:
        return self._cached("hist", (t,), MagnitudeHistogram)

    def _summary_of(self, t: torch.Tensor) -> RangeSummary:
        return self._cached("sum", (t,), RangeSummary)

    def _error_of(self, r: torch.Tensor, y: torch.Tensor) -> ErrorStats:
        return self._cached("err", (r, y), ErrorStats)

    def _clone_ref(self, t: torch.Tensor) -> torch.Tensor:
        hit = self._clone_cache.get(id(t))
        if hit is not None and hit[0] == t._version and hit[1].shape == t.shape:
            return hit[1]
        c = t.detach().clone()
        self._clone_cache[id(t)] = (t._version, c)
        return c

    # -- hooks ---------------------------------------------------------------------------------------
    def _pre_hook(self, m: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._phase == "profile":
            self._profile_pre(m)
            return
        if self._phase is None or self._rerunning:
            return
        with _disable_current_modes():  # our bookkeeping is neither the model's ops nor worth tracking
            self._stack.append(id(m))
            self._own_ops.append(0)
            self._own_work.append(0)
            self._pre_rng.append((self._rng_state(), _snapshot_state(args, kwargs), len(self._draws))
                                 if self._phase == "ref" else None)
            if self._phase == "ref":
                self._layer(m)  # records are ordered by first call (pre-order of execution)
                self._note_consumer(m, args, kwargs)

    def _post_hook(self, m: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._phase == "profile":
            self._profile_post(m)
            return
        if self._phase is None or self._rerunning:
            return
        if not self._stack or self._stack[-1] != id(m):
            return  # a hook registered mid-call; ignore
        # The statistics below run tensor ops; the op tracker must not see them (they are not the model's
        # work, and would make a parent module look as if it computed something itself).
        with _disable_current_modes():
            self._post_hook_body(m, args, kwargs, output)

    def _post_hook_body(self, m: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._stack.pop()
        own_ops = self._own_ops.pop()
        own_work = self._own_work.pop()
        pre_rng = self._pre_rng.pop()
        rec = self._layer(m)
        ys = float_tensors(output)
        diffs: dict[Format, list[torch.Tensor]] = {}
        if self._phase == "ref":
            diffs = self._post_reference(m, rec, args, kwargs, ys, own_ops, pre_rng, own_work)
        else:
            self._post_format(m, rec, ys)
        for i, y in enumerate(ys):
            own = self._phase == "ref" and self._note_producer(rec, i, y)
            if y.requires_grad:
                y.register_hook(self._grad_hook(rec, {f: d[i] for f, d in diffs.items()},
                                                (i, weakref.ref(y)) if own else None))

    def _note_producer(self, rec: LayerRecord, slot: int, y: torch.Tensor) -> bool:
        """Remember ``rec`` as the producer of ``y``; False when an inner module produced it already (a
        container passing its child's output on), True for a new tensor (an in-place op makes a new version)."""
        key = (id(y), y._version)
        hit = self._producers.get(key)
        if hit is not None and hit[0]() is y:
            return False
        self._producers[key] = (weakref.ref(y), rec, slot)
        return True

    def _note_consumer(self, m: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Record ``m`` as a consumer of every input tensor another module produced in this pass."""
        name = self._names.get(id(m), "?")
        for x in float_tensors((args, kwargs)):
            hit = self._producers.get((id(x), x._version))
            if hit is not None and hit[0]() is x:
                hit[1].output_consumers.setdefault(hit[2], set()).add(name)

    def _post_reference(self, m, rec: LayerRecord, args, kwargs, ys, own_ops: int, pre_rng, own_work: int) -> dict:
        rec.calls += 1
        rec.own_ops += own_ops
        if rec.calls == 1:
            rec.output_shapes = [list(y.shape) for y in ys]
        for y in ys:
            rec.activation.merge(self._hist_of(y))
        self._ref_outputs.setdefault(id(m), []).append([self._clone_ref(y) for y in ys])
        computes = own_ops > 0
        rec.computes = rec.computes or computes
        # A container whose own work in this call is additions only (a residual add) is not re-run: its local
        # error would be its children's plus one addition's rounding, at the cost of re-running all of its
        # children once more per format (docs/memory.md, "Local re-runs").
        container = computes and not rec.is_leaf and own_work == 0
        for fmt in self.config.formats:
            fs = rec.formats.setdefault(fmt, FormatLayerStats())
            if rec.name == "":
                fs.local_note = "the whole model: local error equals accumulated error (same inputs)"
            elif not computes:
                if fs.local is None:
                    fs.local_note = ("no computation of its own" if rec.is_leaf
                                     else "a container: its children's local errors are measured")
            elif container and fs.local is None:
                fs.local_note = CONTAINER_NOTE
        if computes and not container and rec.name != "" and self.config.formats and ys:
            return self._local_rerun(m, rec, args, kwargs, ys, pre_rng)
        return {}

    def _local_rerun(self, m, rec: LayerRecord, args, kwargs, ys, pre_rng) -> dict[Format, list[torch.Tensor]]:
        """Re-run ``m`` alone in each format on its FP32 inputs. Returns y_p - y per format and output (kept in
        bf16 until the FP32 backward gives dL/dy for the first-order loss impact <dL/dy, y_p - y>)."""
        diffs: dict[Format, list[torch.Tensor]] = {}
        pre_rng, snapshot, draw_start = pre_rng
        self._rerunning = True
        now = self._rng_state()
        buffer_names = [n for n, _ in m.named_buffers()]
        try:
            for fmt in self.config.formats:
                fs = rec.formats[fmt]
                self._set_rng_state(pre_rng)
                if snapshot is not None:  # objects the call may have changed (a KV cache): as they were before it
                    args, kwargs = copy.deepcopy(snapshot)
                try:
                    try:
                        out = self._rerun_once(m, fmt, args, kwargs, buffer_names, draw_start)
                    except Exception as e:
                        if self._use_gemm_mode or not is_missing_low_precision_kernel(e):
                            raise
                        self._use_gemm_mode = True
                        self._set_rng_state(pre_rng)
                        out = self._rerun_once(m, fmt, args, kwargs, buffer_names, draw_start)
                except torch.OutOfMemoryError:
                    # not a finding of this module: a "not measured" here would read as zero impact to the
                    # planner; the audit stops with cli.py's advice (smaller batch, --device cpu)
                    raise
                except Exception as e:  # the module fails under autocast: reported, not fatal
                    fs.local_note = f"not measured: the module raised under {fmt} autocast: {type(e).__name__}: {e}"
                    continue
                ps = float_tensors(out)
                if len(ps) != len(ys) or any(p.shape != y.shape for p, y in zip(ps, ys)):
                    fs.local_note = "not measured: the re-run returned outputs of another structure"
                    continue
                if fs.local is None:
                    fs.local = ErrorStats()
                    fs.local_note = None
                for y, p in zip(ys, ps):
                    fs.local.update(y, p)
                if any(y.requires_grad for y in ys):
                    # zero where FP32 itself is not finite: FP32's own inf/NaN is no format's loss impact
                    diffs[fmt] = [torch.where(torch.isfinite(y.detach()), p.detach().float() - y.detach(), 0.0)
                                  .to(torch.bfloat16) for y, p in zip(ys, ps)]
        finally:
            self._set_rng_state(now)
            self._rerunning = False
        return diffs

    def _rerun_once(self, m, fmt: Format, args, kwargs, buffer_names: list[str], draw_start: int = 0) -> Any:
        # Buffers are swapped for copies: a re-run must not move BatchNorm's running statistics, nor bump
        # the version of tensors the reference pass saved for its backward. The reference pass's op tracker
        # is switched off meanwhile: re-runs are not counted, and it costs a Python call per op.
        with _disable_current_modes(), rounding_registry_paused(), torch.no_grad(), self._autocast(fmt), \
                self._same_draws(fmt, draw_start):
            if not buffer_names:
                return m(*args, **kwargs)
            buffers = {n: b.detach().clone() for n, b in m.named_buffers() if b is not None}
            return torch.func.functional_call(m, buffers, args, kwargs, strict=False)

    def _post_format(self, m, rec: LayerRecord, ys) -> None:
        fmt = self._phase
        assert isinstance(fmt, Format)
        fs = rec.formats.setdefault(fmt, FormatLayerStats())
        fs.calls += 1
        k = self._call_index.get(id(m), 0)
        self._call_index[id(m)] = k + 1
        for y in ys:
            fs.activation.merge(self._summary_of(y))
            fs.output_dtypes.add(str(y.dtype).removeprefix("torch."))
        refs = self._ref_outputs.get(id(m), [])
        if k >= len(refs) or len(refs[k]) != len(ys) or any(r.shape != y.shape for r, y in zip(refs[k], ys)):
            fs.unmatched_calls += 1
            return
        for r, y in zip(refs[k], ys):
            fs.accumulated.merge(self._error_of(r, y))

    def _grad_hook(self, rec: LayerRecord, diffs: dict[Format, torch.Tensor] | None = None,
                   own: tuple[int, Any] | None = None):
        """``own``: (slot, weak reference to the tensor) when ``rec`` produced it (reference pass)."""
        phase = self._phase

        def hook(g: torch.Tensor) -> None:
            if g is None:
                return
            if phase == "ref":
                h = MagnitudeHistogram()
                h.update(g)
                rec.grad_output.merge(h)
                self.grad_all.merge(h)
                if own is not None:
                    y, loss = own[1](), self._loss_ref() if self._loss_ref is not None else None
                    # dL/dL of the loss itself (or of a scalar the model returns as a loss): not a gradient
                    # any format computes, so it is kept apart from the loss-scale statistics
                    if (y is not None and y is loss) or (rec.name == "" and g.numel() == 1):
                        rec.grad_loss.merge(h)
                    else:
                        rec.grad_output_own.setdefault(own[0], MagnitudeHistogram()).merge(h)
                for f, d in (diffs or {}).items():
                    impact = float((g.detach().double() * d.double()).sum())
                    fs = rec.formats[f]
                    fs.loss_impact += impact
                    fs.loss_impact_abs += abs(impact)
                    fs.impact_measured = True
            elif isinstance(phase, Format):
                rec.formats[phase].grad_output.update(g)
        return hook

    # -- runs ----------------------------------------------------------------------------------------
    def _run(self, fmt: Format | None) -> tuple[Any, torch.Tensor]:
        """One forward (under autocast for a format) and the loss; errors name the module that raised."""
        counter = SavedTensorCounter(self.model, lambda: self._stack[-1] if self._stack else None)
        try:
            if fmt is None:
                with self._fp32_reference_switches(), counter, self._same_draws(None), _OpTracker(self):
                    out = self._forward(self.model)
                    loss = self._loss_of(out)
                self._loss_ref = weakref.ref(loss)
            else:
                with counter, self._autocast(fmt), self._same_draws(fmt):
                    out = self._forward(self.model)
                    loss = self._loss_of(out)
            key = "fp32" if fmt is None else fmt.value
            self.memory[key] = {"activation_bytes": counter.tally.activation_bytes,
                                "weight_copy_bytes": counter.tally.weight_copy_bytes}
            for mid, nbytes in counter.tally.by_module.items():
                self._layer(self._modules[mid]).saved_bytes[key] = nbytes
        except (torch.OutOfMemoryError, AuditError):
            # the user's own errors (a loss_fn returning a vector) and OOM (cli.py advises a smaller batch) pass as is
            self._stack.clear()
            raise
        except Exception as e:
            where = self._names.get(self._stack[-1], "?") if self._stack else None
            self._stack.clear()
            raise _RunFailure(e, where) from e
        return out, loss

    def reference_run(self) -> RunRecord:
        """FP32 forward and backward with local re-runs; raises :class:`ModelRunError` if the model fails."""
        self._reset()
        self._phase = "ref"
        t0 = time.perf_counter()
        try:
            try:
                out, loss = self._run(None)
            except _RunFailure as f:
                raise ModelRunError(
                    f"the model raised {type(f.error).__name__} in its FP32 forward pass: {f.error}",
                    found=f"in module '{f.where or '(model)'}'" if f.where is not None else None,
                    hint="check that the batch matches what the model's forward expects",
                ) from f.error
            lval = float(loss.detach().float())
            outs = float_tensors(out)
            bad = sum(int((~torch.isfinite(y)).sum()) for y in outs)
            # Non-finite output values the loss does not use (its value is finite) are FP32's own, reported in
            # summary.fp32.nonfinite and left out of every comparison; a non-finite loss leaves nothing to compare.
            if not torch.isfinite(loss.detach()).item():
                raise NumericsError(
                    "the FP32 reference is already not finite, so there is nothing to compare low precision against",
                    found=f"loss = {lval}, {bad} non-finite output element(s)",
                    hint="fix the model or the batch in FP32 first (check for NaN weights or inputs, log of 0, ...)",
                )
            self._phase = None  # no forward hooks during backward (activation checkpointing re-runs forwards)
            try:
                with self._fp32_reference_switches():
                    loss.backward()
            except torch.OutOfMemoryError:
                raise
            except Exception as e:
                raise ModelRunError(f"the model raised {type(e).__name__} in its FP32 backward pass: {e}",
                                    hint="check the model's custom autograd code (backward) in FP32 first") from e
        finally:
            self._phase = None
        # parameter gradients, attributed to the module that owns each parameter
        seen: dict[int, MagnitudeHistogram] = {}
        for mid, rec in self.layers.items():
            for p in self._modules[mid].parameters(recurse=False):
                if p.grad is None:
                    continue
                if id(p) in seen:  # a tied weight: counted once, and known to this module too
                    rec.grad_param_tied.merge(seen[id(p)])
                    continue
                h = MagnitudeHistogram()
                h.update(owned_part(p.grad))  # a rank's share in a distributed audit (docs/distributed.md)
                seen[id(p)] = h
                rec.grad_param.merge(h)
                self.grad_all.merge(h)
                if h.nonfinite:
                    self._ref_grad_nonfinite[id(p)] = ~torch.isfinite(owned_part(p.grad).detach())
        self._clone_cache.clear()
        self._stat_cache.clear()
        self.reference = RunRecord(format=Format.FP32, loss=lval, wall_s=time.perf_counter() - t0)
        return self.reference

    def format_run(self, fmt: Format, loss_scale: float = 1.0) -> RunRecord:
        """Forward under ``fmt`` autocast, backward of ``loss * loss_scale``; failures are recorded, not raised."""
        self._reset()
        self._phase = fmt
        run = RunRecord(format=fmt, loss_scale=loss_scale)
        t0 = time.perf_counter()
        try:
            out, loss = self._run(fmt)
            run.loss = float(loss.detach().float())
            self._phase = None
            # grads are recorded per layer through the hooks registered during the forward
            try:
                with self._backward_context():
                    (loss.float() * loss_scale).backward()
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # a backward that fails only in low precision is this format's finding
                raise _RunFailure(e, "(backward pass)") from e
        except _RunFailure as f:
            self._phase = None
            if self.config.mode == "emulated" and not self._use_gemm_mode and is_missing_low_precision_kernel(f.error):
                # A CPU kernel has no fp16/bf16 version: redo the pass with the fp32-fallback dispatch mode on.
                self._use_gemm_mode = True
                for rec in self.layers.values():
                    if fmt in rec.formats:
                        old = rec.formats[fmt]
                        rec.formats[fmt] = FormatLayerStats(local=old.local, local_note=old.local_note)
                return self.format_run(fmt, loss_scale)
            run.error = f"{type(f.error).__name__}: {f.error}" + (f" (in module '{f.where}')" if f.where else "")
        finally:
            self._phase = None
        root = self.layers.get(id(self.model))
        if root is not None and fmt in root.formats:
            run.output = root.formats[fmt].accumulated
            run.output_nonfinite = run.output.nonfinite
        seen: set[int] = set()
        for mid, rec in self.layers.items():
            fs = rec.formats.setdefault(fmt, FormatLayerStats())
            for p in self._modules[mid].parameters(recurse=False):
                if p.grad is not None and id(p) not in seen:
                    seen.add(id(p))
                    added, shared = self._grad_nonfinite(p)
                    fs.grad_param_nonfinite += added
                    run.param_grads_nonfinite += added
                    run.param_grads_nonfinite_shared += shared
        for p in self.model.parameters():  # parameters no module that ran owns
            if p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                added, shared = self._grad_nonfinite(p)
                run.param_grads_nonfinite += added
                run.param_grads_nonfinite_shared += shared
        if root is not None and fmt in root.formats and root.formats[fmt].local is None:
            root.formats[fmt].local = copy.deepcopy(root.formats[fmt].accumulated)
        run.wall_s = time.perf_counter() - t0
        self._stat_cache.clear()
        self.runs[fmt] = run
        return run

    def _grad_nonfinite(self, p: torch.Tensor) -> tuple[int, int]:
        """(non-finite gradient elements of ``p`` where FP32's is finite, those where FP32's is not finite too)."""
        bad = ~torch.isfinite(owned_part(p.grad).detach())
        ref = self._ref_grad_nonfinite.get(id(p))
        if ref is None or ref.shape != bad.shape:
            return int(bad.sum()), 0
        return int((bad & ~ref).sum()), int((bad & ref).sum())

    def verify_plan(self, policy: Any, default: Format | None) -> RunRecord:
        """One forward with ``policy`` applied (runtime's Policy.apply): its loss and output vs the FP32 reference.

        The plan's default format runs as in the format passes; modules the policy overrides run in their own
        format inside it (fp32: autocast off, inputs cast up). Forward only: the budget is on loss and output.
        """
        self._reset()
        run = RunRecord(format=default or Format.FP32)
        device_type = "cuda" if self.config.mode == "cuda" else "cpu"
        handle = policy.apply(self.model, device_type=device_type)
        try:
            with torch.no_grad(), (self._autocast(default) if default else contextlib.nullcontext()), \
                    self._same_draws(default or Format.FP32):
                out = self._forward(self.model)
                loss = self._loss_of(out)
            run.loss = float(loss.detach().float())
            ref = self._ref_outputs.get(id(self.model))
            ys = float_tensors(out)
            if ref and len(ref[0]) == len(ys):
                run.output = ErrorStats()
                for r, y in zip(ref[0], ys):
                    run.output.update(r, y)
                run.output_nonfinite = run.output.nonfinite
        except torch.OutOfMemoryError:
            raise  # the GPU's limit, not the plan's fault: it must not count as a broken plan
        except Exception as e:  # the plan itself fails: reported as a broken plan, not a crash
            run.error = f"{type(e).__name__}: {e}"
        finally:
            handle.remove()
            self._stack.clear()
        return run

    def timed_steps(self, steps: int, traces: bool = True) -> dict[str, list[float]]:
        """Per format, ``steps`` profiled steps, then ``steps`` clean ones (each after one warm-up step).

        Profiled steps run under torch.profiler with module forwards marked ``module::<name>`` in the traces
        and timed (CPU: wall clock; CUDA: a pair of events per module call); they give the traces (Chrome /
        Perfetto JSON, what TensorBoard's profiler plugin reads; kept in ``self.traces`` for the caller to
        write atomically) and the per-module times. Clean steps run with no profiler, no hooks and no events:
        they give the step times and, on CUDA, the peak memory of a step above what was allocated before it.
        """
        import tempfile
        from pathlib import Path

        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.config.mode == "cuda" else [])
        for fmt in (None, *self.config.formats):
            key = "fp32" if fmt is None else fmt.value
            if fmt is not None and self.runs.get(fmt) and self.runs[fmt].error:
                continue
            self._layer_times = {}
            with tempfile.TemporaryDirectory() as tmp:
                handler = tensorboard_trace_handler(tmp, worker_name=f"precision-audit-{key}", use_gzip=False) \
                    if traces else None
                # one warm-up step first: the profiler's first step carries its start-up cost
                prof = profile(activities=activities, on_trace_ready=handler,
                               schedule=schedule(wait=0, warmup=1, active=steps, repeat=1))
                with _quiet_native_stderr():
                    prof.start()
                try:
                    for i in range(steps + 1):
                        self._reset()
                        self._phase = "profile"
                        try:
                            self._step(fmt)
                            self._sync()
                        finally:
                            self._phase = None
                        if i:
                            self._collect_layer_times()
                        else:
                            self._pending_events.clear()
                            self._step_layer_times = {}
                        with _quiet_native_stderr():
                            prof.step()
                finally:
                    with _quiet_native_stderr():
                        prof.stop()
                for f in sorted(Path(tmp).glob("*.json")):
                    self.traces[f"{key}/{f.name}"] = f.read_bytes()
            for mid, ts in self._layer_times.items():
                if ts:
                    self._layer(self._modules[mid]).measured_time_s[key] = min(ts) if steps else 0.0
            self.step_times[key] = self._clean_steps(fmt, steps)
        self._reset()
        return self.step_times

    def _step(self, fmt: Format | None) -> None:
        """One forward and backward, as a training step runs them (FP32: TF32 off on CUDA)."""
        if fmt is None:
            with self._fp32_reference_switches():
                loss = self._loss_of(self._forward(self.model))
                loss.backward()
        else:
            with self._autocast(fmt):
                loss = self._loss_of(self._forward(self.model))
            with self._backward_context():
                loss.float().backward()

    def _clean_steps(self, fmt: Format | None, steps: int) -> list[float]:
        """``steps`` uninstrumented steps after a warm-up: no profiler, no module hooks, no CUDA events.

        On CUDA the peak allocation of each step is taken above what was allocated when it started (the
        parameters, the batch and what this session keeps, such as the reference outputs): the figure of
        each format is on the same basis, comparable with each other and with a training step's activations,
        gradients and temporaries (docs/gpu.md, "Memory figures").
        """
        key = "fp32" if fmt is None else fmt.value
        times: list[float] = []
        peaks: list[int] = []
        self._remove_hooks()
        try:
            for i in range(steps + 1):
                self._reset()
                base = self._peak_start()
                self._sync()
                t0 = time.perf_counter()
                self._step(fmt)
                self._sync()
                dt = time.perf_counter() - t0
                if i:  # the warm-up step carries one-time costs (kernel selection, workspaces)
                    times.append(dt)
                    if base is not None:
                        peaks.append(int(torch.cuda.max_memory_allocated(self.config.device)) - base)
        finally:
            self._install_hooks()
        if peaks:
            self.memory.setdefault(key, {})["peak_bytes"] = max(peaks)
        return times

    def _peak_start(self) -> int | None:
        if self.config.mode != "cuda":
            return None
        torch.cuda.reset_peak_memory_stats(self.config.device)
        return int(torch.cuda.memory_allocated(self.config.device))

    def _profile_pre(self, m: torch.nn.Module) -> None:
        rf = torch.autograd.profiler.record_function(f"module::{self._names.get(id(m), '?') or '(model)'}")
        rf.__enter__()
        if self.config.mode == "cuda":
            start: Any = torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            start = time.perf_counter()
        self._prof_stack.append((id(m), rf, start))

    def _profile_post(self, m: torch.nn.Module) -> None:
        if not self._prof_stack or self._prof_stack[-1][0] != id(m):
            return
        _, rf, start = self._prof_stack.pop()
        if self.config.mode == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending_events.append((id(m), start, end))
        else:
            self._step_layer_times[id(m)] = self._step_layer_times.get(id(m), 0.0) + time.perf_counter() - start
        rf.__exit__(None, None, None)

    def _collect_layer_times(self) -> None:
        for mid, start, end in self._pending_events:
            self._step_layer_times[mid] = self._step_layer_times.get(mid, 0.0) + start.elapsed_time(end) / 1e3
        self._pending_events.clear()
        for mid, t in self._step_layer_times.items():
            self._layer_times.setdefault(mid, []).append(t)
        self._step_layer_times = {}

    def _sync(self) -> None:
        if self.config.mode == "cuda":
            torch.cuda.synchronize()

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
            warnings=list(self.warnings) + self._draw_warnings(),
            memory=dict(self.memory),
            traces=dict(self.traces),
        )


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Kineto prints 'profiler_start/stop' lines from C++ straight to file descriptor 2; silence them there."""
    import os
    import sys

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _holds_objects(value: Any) -> bool:
    """Whether an argument holds something other than tensors, plain values and containers of them."""
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, complex, str, bytes, torch.dtype,
                                           torch.device, torch.Size, slice, type(Ellipsis))):
        return False
    if isinstance(value, (tuple, list)):
        return any(_holds_objects(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_objects(v) for v in value.values())
    return True


def _snapshot_state(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A copy of the call's arguments taken before it runs, when they hold mutable objects (a KV cache the
    call appends to): the local re-runs must see them as the call did. Tensors are not copied (memo)."""
    if not (_holds_objects(args) or _holds_objects(kwargs)):
        return None
    memo: dict[int, Any] = {}
    for t in _tensors_in((args, kwargs)):
        memo[id(t)] = t
    try:
        return copy.deepcopy((args, kwargs), memo)
    except Exception:  # an object that cannot be copied: the re-runs use the live arguments
        return None


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    return []


class _RunFailure(Exception):
    def __init__(self, error: BaseException, where: str | None) -> None:
        super().__init__(str(error))
        self.error = error
        self.where = where
