"""The FP32 reference pass: outputs, gradients and each module's local error (a re-run alone per format).

One instrumented FP32 forward and backward on the user's model (capture/session.py runs the hooks). Per module
call it streams the output's magnitude histogram, keeps an FP32 clone of the output for the format passes to
compare against, and re-runs the module alone in each format on its exact FP32 inputs (same RNG state, same
random draws, buffers swapped for copies) for its *local* error; the difference y_p - y is kept in bf16 until
the backward gives dL/dy, for the first-order loss impact <dL/dy, y_p - y>. Containers whose own work is only
additions are not re-run, and a parent's re-run takes its children's re-run outputs where the call is the same
(capture/rerun_reuse.py; docs/memory.md, "Local re-runs"). The backward gives dL/dy and dL/dW histograms.

:class:`ReferencePass` is a part of :class:`~precision_audit.capture.session.CaptureSession` (it shares the
session's per-pass state); it holds no state of its own.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .. import host_rng
from ..emulation import is_missing_low_precision_kernel, rounding_registry_paused
from ..errors import ModelRunError, NumericsError
from ..formats import Format
from .call_args import copy_arguments
from .failures import RunFailure
from .model_state import module_attributes, put_attributes_back
from .output_grads import autograd_nodes
from .records import FormatLayerStats, LayerRecord, RunRecord, float_tensors
from .reference_store import Kept
from .rerun_reuse import ChildCall, ChildReruns, child_call, substituting
from .session_state import RngState, SessionState
from .shards import owned_part
from .stats import ErrorStats, MagnitudeHistogram, dot64, nonfinite_elements, nonfinite_where
from .user_autocast import UserRegion

CONTAINER_NOTE = ("not re-run: container (its own work is only additions; its children's local errors are "
                  "measured)")


def batch_call_note(fmt: Format) -> str:
    """A call on the batch itself whose local error the ``fmt`` pass did not reach (it failed before)."""
    return f"not measured: its inputs are the batch, so its local error is the {fmt} pass's, which did not reach it"


IN_PLACE_NOTE = ("not measured: the module changed its input in place, so the FP32 input a re-run needs is gone "
                 "(and a re-run would change the FP32 pass's tensors again)")


class PreCall(NamedTuple):
    """What the FP32 pass keeps from before a module call, for its local re-runs."""

    rng: RngState
    # the arguments as they were before the call, where it may change them: mutable objects (a KV cache), and the
    # tensors themselves, copied, for a module that declares it writes its input (``inplace=True``)
    snapshot: tuple[tuple, dict] | None
    draw_start: int
    versions: list[int]  # of the tensor arguments before the call (_tensors_in order)
    copied: bool  # ``snapshot`` holds copies of the tensor arguments
    # the model's own autocast region the call is inside, innermost (capture/user_autocast.py), or None
    user_region: UserRegion | None
    # the attributes of the module and every module inside it (references): a re-run starts from them (a call
    # counter the call itself bumped is put back first)
    attributes: list[tuple[torch.nn.Module, dict[str, Any]]]
    tensors: tuple[torch.Tensor, ...] = ()  # the tensor arguments (a child's re-run outputs: capture/rerun_reuse.py)


def pre_call(rng: RngState, m: torch.nn.Module, args: tuple, kwargs: dict, draw_start: int,
             user_region: UserRegion | None = None) -> PreCall:
    """The record of a module call's state before it runs. ``nn.ReLU(inplace=True)``, ``nn.SiLU(inplace=True)``,
    ``nn.Dropout(inplace=True)`` ... overwrite their input with their output: their arguments are copied, so the
    re-runs start from the FP32 input (and write into the copy, not into the FP32 pass's tensors)."""
    ts = _tensors_in((args, kwargs))
    if getattr(m, "inplace", False) is True and ts:
        # None: an argument that cannot be copied: not re-run if the call changes its input (IN_PLACE_NOTE)
        copied = copy_arguments((args, kwargs), clone_tensors=True)
        if copied is not None:
            return PreCall(rng, copied, draw_start, [t._version for t in ts], True, user_region, module_attributes(m),
                           tuple(ts))
    return PreCall(rng, snapshot_state(args, kwargs), draw_start, [t._version for t in ts], False, user_region,
                   module_attributes(m), tuple(ts))


@dataclass
class BatchCall:
    """A module call whose every tensor argument is one of the batch's own tensors, unchanged (docs/performance.md,
    "Calls on the batch"): the model's body under its task head, an encoder on the input features.

    Its inputs in a format pass are the FP32 pass's by identity, so its local error is its output there: the
    format pass measures it instead of a re-run alone per format, which for such a module is a whole forward of
    most of the model. Kept until then: the random state before the call, its arguments, the FP32 pass's dL/dy
    of each output (for the first-order loss impact), and, at the second order (which keeps no FP32 outputs),
    the outputs themselves.
    """

    rng: RngState
    args: tuple
    kwargs: dict
    versions: list[int]  # of the tensor arguments, in _tensors_in order: an in-place change disqualifies
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # output slot -> dL/dy of the FP32 backward
    refs: list[Kept] | None = None  # the FP32 outputs, where the pass keeps none (state.impacts_only)
    user_region: UserRegion | None = None  # inside the model's own autocast region (PreCall)
    attributes: list[tuple[torch.nn.Module, dict[str, Any]]] = field(default_factory=list)  # before the call


class ReferencePass(SessionState):
    """The FP32 reference pass of a :class:`~precision_audit.capture.session.CaptureSession` (a mixin)."""

    def reference_run(self) -> RunRecord:
        """FP32 forward and backward with local re-runs; raises :class:`ModelRunError` if the model fails. Over ranks,
        its statistics are every rank's once it returns (capture/ranks.py)."""
        with self.ranks.reference_pass(self.state.impacts_only):
            run = self._reference_pass()
        self.grad_all = self.ranks.reference_done(list(self.layers.values()), self.grad_all)
        return run

    def _reference_pass(self) -> RunRecord:
        self._reset()
        self.state.batch_tensors, self.state.batch_call_records, self.state.grad_edges = {}, {}, []
        self.state.child_reruns.clear()
        if not self.state.impacts_only:  # the format passes' snapshots of this pass's figures (format_pass.py)
            self.state.after_reference, self.state.pass_draw_mismatches = {}, {}
        self.state.phase = "ref"
        t0 = time.perf_counter()
        try:
            try:
                out, loss = self._run(None)
                if self.state.on_reference_output is not None:  # the noise floor's FP32 forward (capture/noise.py)
                    self.state.on_reference_output(out, loss)
            except RunFailure as f:
                raise ModelRunError(
                    f"the model raised {type(f.error).__name__} in its FP32 forward pass: {f.error}",
                    found=f"in module '{f.where or '(model)'}'" if f.where is not None else None,
                    hint="check that the batch matches what the model's forward expects",
                ) from f.error
            lval = float(loss.detach().float())
            self._check_finite_reference(out, loss, lval)
            _check_loss_has_graph(loss)
            self.state.phase = None  # no forward hooks during backward (activation checkpointing re-runs forwards)
            try:
                with self._fp32_reference_switches():
                    self._reference_backward(loss)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:
                hint = ("an op of the forward changes a tensor in place after autograd saved it, which stops a "
                        "training step with the same error: make that op out of place (x = x * 2 instead of "
                        "x.mul_(2), inplace=False)" if "modified by an inplace operation" in str(e)
                        else "check the model's custom autograd code (backward) in FP32 first")
                raise ModelRunError(f"the model raised {type(e).__name__} in its FP32 backward pass: {e}",
                                    hint=hint) from e
        finally:
            self.state.phase = None
            self.state.child_reruns.clear()
        if not self.state.impacts_only:
            self._param_grad_histograms()
        self.state.clone_cache.clear()
        self._stat_cache.clear()
        self.reference = RunRecord(format=Format.FP32, loss=lval, wall_s=time.perf_counter() - t0)
        return self.reference

    def _reference_backward(self, loss: torch.Tensor) -> None:
        """The FP32 backward. At the second order (``state.impacts_only``) only dL/dy of the module outputs the loss
        impacts read is asked for, so autograd skips every parameter's gradient (docs/performance.md, "Second
        order"); a graph with reentrant activation checkpointing, which supports ``backward()`` only, and one where a
        view output was changed in place (its hook moved to a node: capture/output_grads.py) take the whole
        backward."""
        edges, self.state.grad_edges = self.state.grad_edges, []
        reentrant = _reentrant_checkpoint(loss)
        if reentrant and not self.state.impacts_only and not any("reentrant autograd" in w for w in self.warnings):
            self.warnings.append(
                "the model checkpoints activations with a reentrant autograd function of its own (not "
                "torch.utils.checkpoint, which the audit runs non-reentrant: docs/memory.md): the modules inside "
                "those segments have no gradient ranges and no first-order loss impacts; use "
                "torch.utils.checkpoint or turn the library's checkpointing off for the audit")
        if not (self.state.impacts_only and self.ranks.outputs_only_backward) or self.state.views_rebased or reentrant:
            loss.backward()
        elif edges:
            torch.autograd.grad(loss, edges, allow_unused=True)

    @staticmethod
    def _check_finite_reference(out: Any, loss: torch.Tensor, lval: float) -> None:
        # Non-finite output values the loss does not use (its value is finite) are FP32's own, reported in
        # summary.fp32.nonfinite and left out of every comparison; a non-finite loss leaves nothing to compare.
        # Only then are the outputs' non-finite elements counted, for the message, a piece at a time: a count over a
        # whole output (sum of a bool mask) makes an int64 copy of it on CUDA, 3.4 GiB on a GPT's logits, which set
        # the audit's peak GPU memory (an H200, 2026-11-28; docs/memory.md, "Statistics' temporaries")
        if torch.isfinite(loss.detach()).item():
            return
        bad = sum(nonfinite_elements(y) for y in float_tensors(out))
        raise NumericsError(
            "the FP32 reference is already not finite, so there is nothing to compare low precision against",
            found=f"loss = {lval}, {bad} non-finite output element(s)",
            hint="fix the model or the batch in FP32 first (check for NaN weights or inputs, log of 0, ...)",
        )

    def _param_grad_histograms(self) -> None:
        """Parameter gradients, attributed to the module that owns each parameter."""
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
                    self.state.ref_grad_nonfinite[id(p)] = nonfinite_where(owned_part(p.grad).detach())
        # those taken from the backward as they arrived, over ranks (capture/ranks.py)
        self.ranks.param_grads_taken(self.layers, self._modules, self.grad_all, self.state.ref_grad_nonfinite)

    def _note_producer(self, rec: LayerRecord, slot: int, y: torch.Tensor) -> bool:
        """Remember ``rec`` as the producer of ``y``; False when an inner module produced it already (a
        container passing its child's output on), True for a new tensor (an in-place op makes a new version)."""
        key = (id(y), y._version)
        hit = self.state.producers.get(key)
        if hit is not None and hit[0]() is y:
            return False
        self.state.producers[key] = (weakref.ref(y), rec, slot)
        return True

    def _note_consumer(self, m: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Record ``m`` as a consumer of every input tensor another module produced in this pass."""
        name = self._names.get(id(m), "?")
        for x in float_tensors((args, kwargs)):
            hit = self.state.producers.get((id(x), x._version))
            if hit is not None and hit[0]() is x:
                hit[1].output_consumers.setdefault(hit[2], set()).add(name)

    def _post_reference(self, m, rec: LayerRecord, args, kwargs, ys, own_ops: int, pre_rng, own_work: int) -> dict:
        # the re-run outputs kept of the calls inside this one: taken off the pass, freed when this returns
        children = self.state.child_reruns.take((id(m), len(self.calls.stack)))
        if self.state.impacts_only:
            # the repeat at the second order: no op tracker ran; the first pass's counts of the same call
            own_ops, own_work = self.state.call_ops.get((id(m), rec.calls), (own_ops, own_work))
        else:
            self.state.call_ops[(id(m), rec.calls)] = (own_ops, own_work)
        rec.calls += 1
        rec.own_ops += own_ops
        if rec.calls == 1:
            rec.output_shapes = [list(y.shape) for y in ys]
        if not self.state.impacts_only:  # histograms and FP32 references: the first pass's records only
            for y in ys:
                rec.activation.merge(self._hist_of(y))
            self.state.ref_outputs.setdefault(id(m), []).append([self._clone_ref(y) for y in ys])
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
            if not pre_rng.copied and any(t._version != v for t, v in zip(_tensors_in((args, kwargs)),
                                                                           pre_rng.versions)):
                for fmt in self.config.formats:
                    if rec.formats[fmt].local is None:
                        rec.formats[fmt].local_note = IN_PLACE_NOTE
                return {}
            call = self._batch_call(args, kwargs, pre_rng)
            if call is None:
                return self._local_rerun(m, rec, args, kwargs, ys, pre_rng, children)
            self._defer_to_format_passes(m, rec, call, ys)
        return {}

    def _batch_call(self, args, kwargs, pre_rng: PreCall) -> BatchCall | None:
        """A :class:`BatchCall` when every tensor argument of this call is one of the batch's, unchanged, and the
        format passes can stand in for its re-runs (emulated mode, one process, no mutable objects in the call)."""
        rng, snapshot = pre_rng.rng, pre_rng.snapshot
        if not self.ranks.batch_calls or self.config.mode != "emulated" or snapshot is not None:
            return None
        ts = _tensors_in((args, kwargs))
        for t in ts:
            hit = self.state.batch_tensors.get(id(t))
            if hit is None or hit[0] is not t or hit[1] != t._version:
                return None
        return BatchCall(rng=rng, args=args, kwargs=kwargs, versions=[t._version for t in ts],
                         user_region=pre_rng.user_region, attributes=pre_rng.attributes)

    def _defer_to_format_passes(self, m, rec: LayerRecord, call: BatchCall, ys) -> None:
        self.state.batch_call_records[(id(m), rec.calls - 1)] = call
        for fmt in self.config.formats:
            fs = rec.formats[fmt]
            if fs.local is None:
                fs.local_note = batch_call_note(fmt)
        if self.state.impacts_only:
            call.refs = [self.state.refs.keep(y) for y in ys]
        for i, y in enumerate(ys):
            if y.requires_grad:
                self.state.out_hooks.register(y, _keep_grad(call, i), functools.partial(self._grad_lost, rec, i))

    def _local_rerun(self, m, rec: LayerRecord, args, kwargs, ys, pre: PreCall,
                     children: list[ChildCall] | None = None) -> dict[Format, list[Kept]]:
        """:meth:`_rerun_alone`, as the ranks run it (capture/ranks.py)."""
        return self.ranks.local_rerun(rec, ys, lambda: self._rerun_alone(m, rec, args, kwargs, ys, pre, children))

    def _rerun_alone(self, m, rec: LayerRecord, args, kwargs, ys, pre: PreCall,
                     children: list[ChildCall] | None = None) -> dict[Format, list[Kept]]:
        """Re-run ``m`` alone in each format on its FP32 inputs. Returns y_p - y per format and output (kept in
        bf16 until the FP32 backward gives dL/dy for the first-order loss impact <dL/dy, y_p - y>). ``children``:
        the re-run outputs of the calls inside this one, which its re-runs take instead of computing them again;
        this call's own are kept for its parent's re-runs (capture/rerun_reuse.py)."""
        diffs: dict[Format, list[Kept]] = {}
        pre_rng, snapshot, draw_start = pre.rng, pre.snapshot, pre.draw_start
        self.calls.rerunning = True
        now = self._rng_state()
        buffer_names = [n for n, _ in m.named_buffers()]
        attributes = module_attributes(m)  # after the call: what the re-runs leave the module as
        mine = self._child_call(m, args, kwargs, pre, now, attributes)
        try:
            for fmt in self.config.formats:
                put_attributes_back(pre.attributes)  # before the call: what each re-run starts from
                fs = rec.formats[fmt]
                self._set_rng_state(pre_rng)
                if snapshot is not None:  # what the call may have changed (a KV cache, its input): as it was before
                    # a fresh copy of the objects each time; the tensors shared, or cloned where the module writes
                    # its input (capture/call_args.py); the snapshot itself if it cannot be copied again
                    args, kwargs = copy_arguments(snapshot, clone_tensors=pre.copied) or snapshot
                try:
                    try:
                        out = self._rerun_once(m, fmt, args, kwargs, buffer_names, draw_start, pre.user_region,
                                               children)
                    except Exception as e:
                        if self._use_gemm_mode or not is_missing_low_precision_kernel(e):
                            raise
                        self._use_gemm_mode = True
                        self._set_rng_state(pre_rng)
                        out = self._rerun_once(m, fmt, args, kwargs, buffer_names, draw_start, pre.user_region)
                except torch.OutOfMemoryError:
                    # not a finding of this module: a "not measured" here would read as zero impact to the
                    # planner; the audit stops with cli/main.py's advice (smaller batch, --device cpu)
                    raise
                except Exception as e:  # the module fails under autocast: reported, not fatal
                    fs.local_note = f"not measured: the module raised under {fmt} autocast: {type(e).__name__}: {e}"
                    continue
                if mine is not None and _same_rng(self._rng_state(), pre_rng):  # it drew no random numbers
                    mine.keep(fmt, out, self._use_gemm_mode)
                ps = float_tensors(out)
                if len(ps) != len(ys) or any(p.shape != y.shape for p, y in zip(ps, ys)):
                    fs.local_note = "not measured: the re-run returned outputs of another structure"
                    continue
                if fs.local is None:
                    fs.local = ErrorStats()
                    fs.local_note = None
                finite: list[bool | None] = []
                for y, p in zip(ys, ps):
                    if self.state.impacts_only:  # the second order's local errors are not read (capture/noise.py)
                        finite.append(None)
                        continue
                    before = fs.local.ref_nonfinite
                    fs.local.update(y, p)
                    finite.append(fs.local.ref_nonfinite == before)
                if any(y.requires_grad for y in ys):
                    diffs[fmt] = [self.state.refs.stash(_diff_bf16(y.detach(), p.detach(), ok))
                                  for y, p, ok in zip(ys, ps, finite)]
        finally:
            put_attributes_back(attributes)
            self._set_rng_state(now)
            self.calls.rerunning = False
        if mine is not None:
            self.state.child_reruns.add((self.calls.stack[-1], len(self.calls.stack) - 1), mine)
        return diffs

    def _child_call(self, m, args, kwargs, pre: PreCall, after: RngState, attributes) -> ChildCall | None:
        """This call's record for its parent's re-runs (capture/rerun_reuse.py), or None where they cannot take its
        outputs: no parent that is re-run (the model itself), objects among its arguments, its FP32 call drew
        random numbers (``after``: the state after it; ``attributes``: the modules' after it)."""
        stack = self.calls.stack
        if (not ChildReruns.enabled or not stack or stack[-1] in (id(m), id(self.model)) or pre.snapshot is not None
                or pre.copied or not _same_rng(pre.rng, after)):
            return None
        parent: PreCall = self._pre_rng[-1]
        return child_call(m, args, kwargs, pre.rng, pre.attributes, attributes, parent.tensors,
                          parent.user_region == pre.user_region, lambda h: getattr(h, "__self__", None) is self)

    def _same_child_state(self, call: ChildCall, gemm_mode: bool) -> bool:
        """Whether a kept call's outputs hold now (capture/rerun_reuse.py): same kernel mode, same random state."""
        return gemm_mode == self._use_gemm_mode and _same_rng(self._rng_state(), call.rng)

    def _batch_call_output(self, m, fmt: Format, call: BatchCall, refs: list[Kept] | None, args, kwargs,
                           pre: RngState | None, ys: list[torch.Tensor]) -> list[torch.Tensor] | str:
        """The outputs of ``call`` in ``fmt``, matching the FP32 outputs ``refs``: the format pass's own ``ys`` when
        this call got the same tensors and random state as the FP32 one (else a re-run on the FP32 call's
        arguments), or why it is not measured."""
        ts = _tensors_in((args, kwargs))
        ref_ts = _tensors_in((call.args, call.kwargs))
        if any(t._version != v for t, v in zip(ref_ts, call.versions)):
            return "not measured: the batch was changed in place before this call's low-precision pass"
        if (pre is not None and len(ts) == len(ref_ts) and all(a is b for a, b in zip(ts, ref_ts))
                and _same_rng(pre, call.rng)):
            ps = ys
        else:
            now = self._rng_state()
            self.calls.rerunning = True
            attributes = module_attributes(m)
            try:
                put_attributes_back(call.attributes)
                self._set_rng_state(call.rng)
                ps = float_tensors(self._rerun_once(m, fmt, call.args, call.kwargs, [n for n, _ in m.named_buffers()],
                                                    user_region=call.user_region))
            finally:
                put_attributes_back(attributes)
                self._set_rng_state(now)
                self.calls.rerunning = False
        if refs is None or len(ps) != len(refs) or any(r.shape != p.shape for r, p in zip(refs, ps)):
            return "not measured: the re-run returned outputs of another structure"
        return ps

    def _batch_call_impacts(self, call: BatchCall, refs: list[Kept], ps: list[torch.Tensor],
                           local: ErrorStats | None) -> list[float]:
        """The first-order loss impact <dL/dy, y_p - y> of each output with an FP32 gradient, as the re-run's
        would be (same bf16 difference, same product); ``local``: also merge the outputs into this local error."""
        impacts = []
        for i, (r, p) in enumerate(zip(refs, ps)):
            y = self.state.refs.on(r, p)
            finite: bool | None = None
            if local is not None:
                before = local.ref_nonfinite
                local.update(y, p.detach())
                finite = local.ref_nonfinite == before
            g = call.grads.get(i)
            if g is not None:
                d = _diff_bf16(y, p.detach(), finite)
                impacts.append(dot64(g, d))
        return impacts

    def _rerun_once(self, m, fmt: Format, args, kwargs, buffer_names: list[str], draw_start: int = 0,
                    user_region: UserRegion | None = None, children: list[ChildCall] | None = None) -> Any:
        # Buffers are swapped for copies: a re-run must not move BatchNorm's running statistics, nor bump
        # the version of tensors the reference pass saved for its backward. The reference pass's op tracker
        # is switched off meanwhile: re-runs are not counted, and it costs a Python call per op. ``user_region``:
        # the call ran inside the model's own autocast region, and so does its re-run. ``children``: calls inside
        # it whose re-run outputs in ``fmt`` it takes (capture/rerun_reuse.py).
        region = self._user_autocast.region(fmt is not Format.TF32, user_region)
        reuse = substituting(children, fmt, self._same_child_state) if children else contextlib.nullcontext()
        with _disable_current_modes(), rounding_registry_paused(), torch.no_grad(), self._autocast(fmt), region, \
                self._same_draws(fmt, draw_start), reuse:
            if not buffer_names:
                return m(*args, **kwargs)
            buffers = {n: b.detach().clone() for n, b in m.named_buffers() if b is not None}
            return torch.func.functional_call(m, buffers, args, kwargs, strict=False)

    def _reference_grad(self, rec: LayerRecord, g: torch.Tensor, diffs: dict[Format, Kept] | None,
                        own: tuple[int, Any] | None) -> None:
        """dL/dy of one output in the FP32 backward: its histogram, and each format's first-order loss impact."""
        if not self.state.impacts_only:  # the repeat at the second order: histograms are the first pass's records
            self._grad_histograms(rec, g, own)
        for f, d in (diffs or {}).items():
            impact = dot64(g, self.state.refs.for_stats(d, g))
            fs = rec.formats[f]
            fs.loss_impact += impact
            fs.loss_impact_abs += abs(impact)
            fs.impact_measured = True

    def _grad_histograms(self, rec: LayerRecord, g: torch.Tensor, own: tuple[int, Any] | None) -> None:
        h = MagnitudeHistogram()
        h.update(g)
        rec.grad_output.merge(h)
        self.grad_all.merge(h)
        if own is not None:
            y, loss = own[1](), self.state.loss_ref() if self.state.loss_ref is not None else None
            # dL/dL of the loss itself (or of a scalar the model returns as a loss): not a gradient
            # any format computes, so it is kept apart from the loss-scale statistics
            if (y is not None and loss is not None and is_the_loss(y, loss)) or (rec.name == "" and g.numel() == 1):
                rec.grad_loss.merge(h)
            else:
                rec.grad_output_own.setdefault(own[0], MagnitudeHistogram()).merge(h)


#: Set on a loss tensor made from a module's scalar output by an op of the audit's own (the distributed audit's
#: sum over ranks, distributed/session.py): that output, which is then the loss too (held, so that it is still
#: there to be recognised when its gradient arrives).
LOSS_SOURCE = "_precision_audit_loss_source"


def is_the_loss(y: torch.Tensor, loss: torch.Tensor) -> bool:
    """Whether the module output ``y`` is the loss the audit differentiates: the same one-element value (the loss
    itself, a view of it as the loss function's ``reshape(())``, or both views of one tensor), or the output the
    loss was made from (:data:`LOSS_SOURCE`). Its gradient is then dL/dL (times a rank's weight), a float32
    scalar that no format computes."""
    def same_value(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a is b or (a.numel() == 1 == b.numel() and _root(a) is _root(b) and a.data_ptr() == b.data_ptr())

    if same_value(y, loss):
        return True
    made_from = getattr(_root(loss), LOSS_SOURCE, None)
    return isinstance(made_from, torch.Tensor) and same_value(y, made_from)


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage a view shares (``_base`` is always that root, never another view)."""
    return t._base if t._base is not None else t


def _check_loss_has_graph(loss: torch.Tensor) -> None:
    """A loss with no autograd graph (a forward under ``torch.no_grad()``, an output detached) has no backward to
    measure: say that, rather than autograd's "element 0 of tensors does not require grad"."""
    if loss.requires_grad:
        return
    raise ModelRunError(
        "the loss does not require grad: no parameter reaches it through autograd, so there is no backward pass "
        "to measure",
        expected="a loss computed from the model's output with autograd recording (it has a grad_fn)",
        found=f"a loss of {float(loss.detach()):g} without grad_fn (requires_grad=False)",
        hint="remove @torch.no_grad() / torch.inference_mode() from the model's forward, and any .detach() (or "
             ".item() turned back into a tensor) between the parameters and the loss")


def _diff_bf16(y: torch.Tensor, p: torch.Tensor, finite: bool | None) -> torch.Tensor:
    """y_p - y in bf16, zero where FP32 itself is not finite (FP32's own inf/NaN is no format's loss impact).

    ``finite``: whether every element of ``y`` is known finite (None: not known; checked here by its sum, which
    is finite only when every element is). Where it is, the subtraction alone gives the same bits as the masked
    one, in one read of each operand: a low-precision ``p`` is promoted to float32 exactly inside the kernel.
    """
    if y.dtype == torch.float32 and p.dtype in (torch.float32, torch.float16, torch.bfloat16):
        if finite is None:
            finite = bool(torch.isfinite(y.sum()))  # an overflowing sum only takes the masked path below
        if finite:  # computed in float32 and rounded once as it is stored: no float32 temporary
            return torch.sub(p, y, out=torch.empty_like(y, dtype=torch.bfloat16))
    return torch.where(torch.isfinite(y), p.float() - y, 0.0).to(torch.bfloat16)


def _reentrant_checkpoint(loss: torch.Tensor) -> bool:
    """Whether the graph behind ``loss`` holds a reentrant ``torch.utils.checkpoint`` (which raises under
    ``torch.autograd.grad``)."""
    return any(type(fn).__name__ == "CheckpointFunctionBackward" for fn in autograd_nodes(loss))


def _keep_grad(call: BatchCall, slot: int):
    def hook(g: torch.Tensor) -> None:
        if g is not None:
            call.grads[slot] = g.detach().clone()
    return hook


def _same_rng(a: RngState, b: RngState) -> bool:
    if not torch.equal(a[0], b[0]) or not host_rng.same(a[2], b[2]):
        return False
    return a[1] is None and b[1] is None or (a[1] is not None and b[1] is not None and torch.equal(a[1], b[1]))


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


def snapshot_state(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A copy of the call's arguments taken before it runs, when they hold mutable objects (a KV cache the
    call appends to): the local re-runs must see them as the call did. Tensors, wherever they are inside the
    objects, are not copied (capture/call_args.py); an object that cannot be copied: None, and the re-runs use the
    live arguments."""
    if not (_holds_objects(args) or _holds_objects(kwargs)):
        return None
    return copy_arguments((args, kwargs), clone_tensors=False)


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    return []

