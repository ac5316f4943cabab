"""The format passes: the whole model under each low-precision format, against the FP32 reference.

Per format, one forward under autocast (real on CUDA, emulated elsewhere) and the backward of the loss times the
format's loss scale. Per module call it streams the *accumulated* error of each output against the reference
pass's FP32 output of the same call, the outputs' and dL/dy's actual magnitudes, and after the backward the
non-finite parameter gradients the format adds to FP32's own. A pass that fails in low precision is that
format's finding (``RunRecord.error``), not a crash. :meth:`FormatPasses.verify_plan` runs one forward with a
plan's policy applied.

:class:`FormatPasses` is a part of :class:`~precision_audit.capture.session.CaptureSession` (it shares the
session's per-pass state); it holds no state of its own.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from typing import Any

import torch

from ..emulation import is_missing_low_precision_kernel
from ..formats import Format
from .failures import RunFailure
from .records import FormatLayerStats, LayerRecord, RunRecord, float_tensors
from .reference_pass import BatchCall
from .reference_store import Kept
from .session_state import SessionState
from .shards import owned_part
from .stats import ErrorStats, count_nonfinite_pairs, nonfinite_where, stored_values, surely_finite

_SCALARS = (int, float, str, bool, type(None))


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    """A dataclass's field names (``dataclasses.fields`` builds them anew on every call: ~3000 calls an audit)."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def copy_stats(fs: FormatLayerStats) -> FormatLayerStats:
    """``copy.deepcopy(fs)``, at a fraction of its cost (it ran for every module before every format pass): the
    record's scalar fields as they are, its sets of strings and its records of scalars (ErrorStats, RangeSummary)
    copied one level; anything else (a field added later) deep-copied."""
    out = copy.copy(fs)
    for name in _field_names(type(fs)):
        v = getattr(fs, name)
        if isinstance(v, _SCALARS):
            continue
        if isinstance(v, set) and all(isinstance(e, str) for e in v):
            setattr(out, name, set(v))
        elif dataclasses.is_dataclass(v) and not isinstance(v, type) and \
                all(isinstance(getattr(v, g), _SCALARS) for g in _field_names(type(v))) and \
                set(vars(v)) == set(_field_names(type(v))):
            setattr(out, name, copy.copy(v))
        else:
            setattr(out, name, copy.deepcopy(v))
    return out


class FormatPasses(SessionState):
    """The low-precision passes of a :class:`~precision_audit.capture.session.CaptureSession` (a mixin)."""

    def format_run(self, fmt: Format, loss_scale: float = 1.0) -> RunRecord:
        """Forward under ``fmt`` autocast, backward of ``loss * loss_scale``; failures are recorded, not raised. The
        one door into a format pass: over ranks, its statistics are every rank's once it returns (capture/ranks.py)."""
        with self.ranks.format_pass(fmt) as started:
            run = self._format_pass(fmt, loss_scale)
        self.ranks.format_done(fmt, loss_scale, run, started, self.layers, self.layers.get(id(self.model)))
        return run

    def _format_pass(self, fmt: Format, loss_scale: float) -> RunRecord:
        if fmt not in self.state.after_reference:  # the reference pass's figures, for forget_format_pass
            self.state.after_reference[fmt] = {mid: copy_stats(rec.formats[fmt])
                                               for mid, rec in self.layers.items() if fmt in rec.formats}
        self._reset()
        self.state.phase = fmt
        run = RunRecord(format=fmt, loss_scale=loss_scale)
        t0 = time.perf_counter()
        draws_before = self.state.draw_mismatches
        try:
            out, loss = self._run(fmt)
            run.loss = float(loss.detach().float())
            self.state.phase = None
            # grads are recorded per layer through the hooks registered during the forward
            try:
                with self._backward_context(fmt):
                    (loss.float() * loss_scale).backward()
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # a backward that fails only in low precision is this format's finding
                raise RunFailure(e, "(backward pass)") from e
        except RunFailure as f:
            self.state.phase = None
            if self.config.mode == "emulated" and not self._use_gemm_mode and is_missing_low_precision_kernel(f.error):
                # A CPU kernel has no fp16/bf16 version: redo the pass with the fp32-fallback dispatch mode on.
                self._use_gemm_mode = True
                self.forget_format_pass(fmt)
                return self.format_run(fmt, loss_scale)
            run.error = f"{type(f.error).__name__}: {f.error}" + (f" (in module '{f.where}')" if f.where else "")
        finally:
            self.state.phase = None
        root = self.layers.get(id(self.model))
        if root is not None and fmt in root.formats:
            run.output = root.formats[fmt].accumulated
            run.output_nonfinite = run.output.nonfinite
        self._count_grad_nonfinite(fmt, run)
        if root is not None and fmt in root.formats and root.formats[fmt].local is None:
            root.formats[fmt].local = copy.deepcopy(root.formats[fmt].accumulated)
        run.wall_s = time.perf_counter() - t0
        self._stat_cache.clear()
        self.runs[fmt] = run
        self.state.pass_draw_mismatches[fmt] = self.state.draw_mismatches - draws_before
        return run

    def forget_format_pass(self, fmt: Format) -> None:
        """Drop what the format pass of ``fmt`` measured, before it runs again (with the fp32-fallback dispatch, or
        at a lower loss scale): each module's figures go back to what the reference pass left (its re-runs' local
        errors and loss impacts, a call on the batch's note); what the format pass adds (its own figures, the local
        error and impact of calls on the batch: BatchCall) is measured again. In cuda mode its draw mismatches
        are taken back out of the warning's count."""
        after = self.state.after_reference.get(fmt, {})
        for mid, rec in self.layers.items():
            if fmt in rec.formats:
                rec.formats[fmt] = copy.deepcopy(after[mid]) if mid in after else FormatLayerStats()
        self.state.draw_mismatches -= self.state.pass_draw_mismatches.pop(fmt, 0)

    def _count_grad_nonfinite(self, fmt: Format, run: RunRecord) -> None:
        """Non-finite parameter-gradient elements of this pass, per owning module and in all (FP32's own apart)."""
        seen: set[int] = set()
        for mid, rec in self.layers.items():
            fs = rec.formats.setdefault(fmt, FormatLayerStats())
            for p in self._modules[mid].parameters(recurse=False):
                if p.grad is not None and id(p) not in seen:
                    seen.add(id(p))
                    added, shared = self._grad_nonfinite(p, p.grad)
                    fs.grad_param_nonfinite += added
                    run.param_grads_nonfinite += added
                    run.param_grads_nonfinite_shared += shared
        for p in self.model.parameters():  # parameters no module that ran owns
            if p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                added, shared = self._grad_nonfinite(p, p.grad)
                run.param_grads_nonfinite += added
                run.param_grads_nonfinite_shared += shared
        # those taken from the backward as they arrived, over ranks (capture/ranks.py)
        self.ranks.grads_nonfinite_taken(fmt, run, self.layers, self._modules)

    def _grad_nonfinite(self, p: torch.Tensor, grad: torch.Tensor) -> tuple[int, int]:
        """(non-finite elements of ``p``'s gradient where FP32's is finite, those where FP32's is not finite too)."""
        g = owned_part(grad).detach()
        # One read of the gradient, no mask, for the common case (stats.surely_finite: the fused pass's counts on
        # the CPU, else a finite sum); a sum that overflows only takes the exact path below. A sparse gradient:
        # its stored values (the rest are zeros).
        values = stored_values(g)
        if values.is_floating_point() and surely_finite(values):
            return 0, 0
        return count_nonfinite_pairs(nonfinite_where(g), self.state.ref_grad_nonfinite.get(id(p)))

    def verify_plan(self, policy: Any, default: Format | None) -> RunRecord:
        """One forward with ``policy`` applied (the runtime's apply_policy): its loss and output vs the FP32 reference.

        The plan's default format runs as in the format passes; modules the policy overrides run in their own
        format inside it (fp32: autocast off, inputs cast up). Forward only: the budget is on loss and output.
        """
        self._reset()
        run = RunRecord(format=default or Format.FP32)
        device_type = "cuda" if self.config.mode == "cuda" else "cpu"
        from ..runtime.apply import apply_policy

        handle = apply_policy(self.model, policy, device_type=device_type)
        try:
            with torch.no_grad(), (self._autocast(default) if default else contextlib.nullcontext()), \
                    self._same_draws(default or Format.FP32):
                out = self._forward(self.model)
                loss = self._loss_of(out)
            run.loss = float(loss.detach().float())
            ref = self.state.ref_outputs.get(id(self.model))
            ys = float_tensors(out)
            if ref and len(ref[0]) == len(ys):
                run.output = ErrorStats()
                for r, y in zip(ref[0], ys):
                    run.output.update(self.state.refs.for_stats(r, y), y)
                run.output_nonfinite = run.output.nonfinite
        except torch.OutOfMemoryError:
            raise  # the GPU's limit, not the plan's fault: it must not count as a broken plan
        except Exception as e:  # the plan itself fails: reported as a broken plan, not a crash
            run.error = f"{type(e).__name__}: {e}"
        finally:
            handle.remove()
            self.calls.stack.clear()
        return run

    def _post_format(self, m, rec: LayerRecord, ys, args, kwargs, pre) -> None:
        fmt = self.state.phase
        assert isinstance(fmt, Format)
        fs = rec.formats.setdefault(fmt, FormatLayerStats())
        fs.calls += 1
        k = self.state.call_index.get(id(m), 0)
        self.state.call_index[id(m)] = k + 1
        for y in ys:
            fs.activation.merge(self._summary_of(y))
            fs.output_dtypes.add(str(y.dtype).removeprefix("torch."))
        refs = self.state.ref_outputs.get(id(m), [])
        matched = k < len(refs) and len(refs[k]) == len(ys) and all(r.shape == y.shape for r, y in zip(refs[k], ys))
        call = self.state.batch_call_records.get((id(m), k))
        if call is not None:  # a call on the batch: its local error is this output's (BatchCall)
            self._measure_batch_call(m, fs, fmt, call, refs[k] if matched else None, args, kwargs, pre, ys)
        if not matched:
            fs.unmatched_calls += 1
            return
        for r, y in zip(refs[k], ys):
            fs.accumulated.merge(self._error_of(r, y))

    def _measure_batch_call(self, m, fs: FormatLayerStats, fmt: Format, call: BatchCall,
                            refs: list[Kept] | None, args, kwargs, pre, ys) -> None:
        """The local error and the loss impact of a call on the batch, from this pass's output of it."""
        ps = self._batch_call_output(m, fmt, call, refs, args, kwargs, pre, ys)
        if isinstance(ps, str):
            fs.local_note = ps
            return
        assert refs is not None  # a structure that matches them
        if fs.local is None:
            fs.local = ErrorStats()
            fs.local_note = None
        for v in self._batch_call_impacts(call, refs, ps, fs.local):
            fs.loss_impact += v
            fs.loss_impact_abs += abs(v)
            fs.impact_measured = True

    def _post_batch_only(self, m, args, kwargs, pre, ys) -> None:
        """A forward at the second order (capture/noise.py): each call on the batch's |loss impact| at that order,
        from the outputs that pass's FP32 repeat kept (BatchCall.refs), into ``state.batch_sink``."""
        fmt = self.state.phase
        assert isinstance(fmt, Format) and self.state.batch_sink is not None
        k = self.state.call_index.get(id(m), 0)
        self.state.call_index[id(m)] = k + 1
        call = self.state.batch_call_records.get((id(m), k))
        if call is None or call.refs is None:
            return
        ps = self._batch_call_output(m, fmt, call, call.refs, args, kwargs, pre, ys)
        if isinstance(ps, str):
            return
        impacts = self._batch_call_impacts(call, call.refs, ps, None)
        if impacts:
            per = self.state.batch_sink.setdefault(self._names.get(id(m), "?"), {})
            per[fmt] = per.get(fmt, 0.0) + sum(abs(v) for v in impacts)
