"""The timed steps: clean steps (step times, CUDA peak memory), instrumented steps (per-module forward times) and,
when asked (``--trace``), profiled steps for the traces (docs/gpu.md, "Timed steps").

:class:`StepTimer` belongs to one :class:`~precision_audit.capture.session.CaptureSession`: it runs whole
training steps (forward and backward, no optimizer) on the session's model through the session's own reset,
autocast and hooks, and keeps its own timing state. The session's module hooks call :meth:`StepTimer.pre` and
:meth:`StepTimer.post` while an instrumented or profiled step runs (phase ``"profile"``).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..formats import Format

if TYPE_CHECKING:
    from .session import CaptureSession

log = logging.getLogger(__name__)


def has_compiled_parts(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a ``torch.compile``'d submodule (its OptimizedModule wrapper)."""
    return any(type(m).__name__ == "OptimizedModule" for m in model.modules())


class StepTimer:
    """Per format, clean steps then instrumented steps on a session's model; profiled ones on request (see
    :meth:`run`)."""

    def __init__(self, session: CaptureSession) -> None:
        self.s = session
        self.cuda = session.config.mode == "cuda"
        self._prof_stack: list[tuple[int, Any, Any]] = []
        self._pending_events: list[tuple[int, Any, Any]] = []
        self._step_layer_times: dict[int, float] = {}
        self._layer_times: dict[int, list[float]] = {}
        #: cuda mode, a model with torch.compile'd parts: the clean steps run them compiled (None: not tried yet)
        self._compiled: bool | None = None

    def run(self, steps: int, traces: bool = False) -> dict[str, list[float]]:
        """Per format, one warm-up and ``steps`` clean steps, then ``steps`` instrumented ones; with ``traces``,
        after every format, ``steps`` profiled steps per format under one ``torch.profiler`` session.

        Clean steps run with no profiler, no hooks and no per-module events, and on CUDA a compiled model's
        compiled parts run compiled: they give the step times (a pair of CUDA events around each step on a GPU,
        the wall clock on a CPU) and, on CUDA, the peak memory of a step above what was allocated before it.
        Instrumented steps mark each module's forward (``module::<name>``) and time it (CUDA: a pair of events
        per call; CPU: the wall clock), eagerly: they give the per-module times. Profiled steps (one warm-up each
        format, the profiler's start-up paid once) give the traces (Chrome / Perfetto JSON, what TensorBoard's
        profiler plugin reads; kept in the session's ``traces`` for the caller to write atomically).
        """
        s = self.s
        timed: list[Format | None] = []
        for fmt in (None, *s.config.formats):
            key = "fp32" if fmt is None else fmt.value
            if fmt is not None and s.runs.get(fmt) and s.runs[fmt].error:
                continue
            timed.append(fmt)
            s.step_times[key] = self._clean_steps(fmt, steps)
            self._layer_times = {}
            for _ in range(steps):
                self._instrumented_step(fmt)
                self._collect_layer_times()
            for mid, ts in self._layer_times.items():
                if ts:
                    s._layer(s._modules[mid]).measured_time_s[key] = min(ts)
        if traces and steps:
            self._profiled(timed, steps)
        s._reset()
        return s.step_times

    def _instrumented_step(self, fmt: Format | None) -> None:
        s = self.s
        s._reset()
        s._phase = "profile"
        try:
            self.step(fmt)
            self._sync()
        finally:
            s._phase = None

    def _profiled(self, formats: list[Format | None], steps: int) -> None:
        """One warm-up and ``steps`` profiled steps per format, under one profiler; the traces go to the
        session's ``traces`` as ``<format>/<file>``."""
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        s = self.s
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with tempfile.TemporaryDirectory() as tmp:
            current = [""]

            def ready(prof: Any) -> None:  # the end of a format's active steps: its trace, in its folder
                key = current[0]
                tensorboard_trace_handler(str(Path(tmp) / key), worker_name=f"precision-audit-{key}",
                                          use_gzip=False)(prof)

            # per format one warm-up step first: the profiler's first step carries its start-up cost
            prof = profile(activities=activities, on_trace_ready=ready,
                           schedule=schedule(wait=0, warmup=1, active=steps, repeat=len(formats)))
            with _quiet_native_stderr():
                prof.start()
            try:
                with warnings.catch_warnings():
                    # each format's cycle is its own trace: what torch warns of at the second cycle is the intent
                    warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each")
                    self._profile_formats(prof, formats, steps, current)
            finally:
                with _quiet_native_stderr():
                    prof.stop()
            for f in sorted(Path(tmp).glob("*/*.json")):
                s.traces[f"{f.parent.name}/{f.name}"] = f.read_bytes()

    def _profile_formats(self, prof: Any, formats: list[Format | None], steps: int, current: list[str]) -> None:
        for fmt in formats:
            current[0] = "fp32" if fmt is None else fmt.value
            for _ in range(steps + 1):
                self._instrumented_step(fmt)
                self._pending_events.clear()  # the instrumented steps' times are the ones kept
                self._step_layer_times = {}
                with _quiet_native_stderr():
                    prof.step()

    def step(self, fmt: Format | None) -> None:
        """One forward and backward, as a training step runs them (TF32 off on CUDA, but for the TF32 format)."""
        s = self.s
        if fmt is None:
            with s._fp32_reference_switches():
                loss = s._loss_of(s._forward(s.model))
                loss.backward()
        else:
            with s._autocast(fmt):
                loss = s._loss_of(s._forward(s.model))
            with s._backward_context(fmt):
                loss.float().backward()

    def _clean_steps(self, fmt: Format | None, steps: int) -> list[float]:
        """One warm-up and ``steps`` uninstrumented steps: no profiler, no module hooks, no per-module events.

        On CUDA the peak allocation of each step is taken above what was allocated when it started (the
        parameters, the batch and what this session keeps, such as the reference outputs): the figure of
        each format is on the same basis, comparable with each other and with a training step's activations,
        gradients and temporaries (docs/gpu.md, "Memory figures").
        """
        s = self.s
        key = "fp32" if fmt is None else fmt.value
        times: list[float] = []
        peaks: list[int] = []
        s._remove_hooks()
        try:
            for i in range(steps + 1):
                s._reset()
                base = self._peak_start()
                self._sync()
                run = self._timed_step if i else self._warm_up
                dt = run(fmt)
                if i:  # the warm-up step carries one-time costs (kernel selection, workspaces, compiling)
                    times.append(dt)
                    if base is not None:
                        peaks.append(int(torch.cuda.max_memory_allocated(s.config.device)) - base)
        finally:
            s._install_hooks()
        if peaks:
            s.memory.setdefault(key, {})["peak_bytes"] = max(peaks)
        return times

    def _stance(self) -> contextlib.AbstractContextManager[Any]:
        """The clean steps' torch.compile stance: a cuda-mode model's compiled parts run compiled, as in training
        (the session runs them eagerly for its hooks and statistics); emulated, eagerly (the emulation sees ops)."""
        if self._compiled:
            return torch.compiler.set_stance("default")
        return contextlib.nullcontext()

    def _warm_up(self, fmt: Format | None) -> float:
        if self._compiled is None:
            self._compiled = self.cuda and has_compiled_parts(self.s.model)
        if self._compiled:
            try:
                with self._stance():
                    self.step(fmt)
                self._sync()
                return 0.0
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # it ran eagerly in every pass: the compiler's failure, not the model's
                self._compiled = False
                msg = (f"the model's torch.compile'd parts failed to compile for the timed steps "
                       f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}): its step times "
                       "are its eager ones")
                log.warning("%s", msg)
                self.s.warnings.append(msg)
                self.s._reset()
        self.step(fmt)
        self._sync()
        return 0.0

    def _timed_step(self, fmt: Format | None) -> float:
        """Seconds of one clean step: a pair of CUDA events around it on a GPU, the wall clock on a CPU."""
        with self._stance():
            if not self.cuda:
                t0 = time.perf_counter()
                self.step(fmt)
                return time.perf_counter() - t0
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.step(fmt)
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3

    def _peak_start(self) -> int | None:
        if not self.cuda:
            return None
        torch.cuda.reset_peak_memory_stats(self.s.config.device)
        return int(torch.cuda.memory_allocated(self.s.config.device))

    def pre(self, m: torch.nn.Module) -> None:
        """A module's forward starts in a profiled step: open its ``module::<name>`` range and its timer."""
        rf = torch.autograd.profiler.record_function(f"module::{self.s._names.get(id(m), '?') or '(model)'}")
        rf.__enter__()
        if self.cuda:
            start: Any = torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            start = time.perf_counter()
        self._prof_stack.append((id(m), rf, start))

    def post(self, m: torch.nn.Module) -> None:
        """A module's forward ends in a profiled step: close its range, add its time."""
        if not self._prof_stack or self._prof_stack[-1][0] != id(m):
            return
        _, rf, start = self._prof_stack.pop()
        if self.cuda:
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
        if self.cuda:
            torch.cuda.synchronize()


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

