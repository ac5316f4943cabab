"""The timed steps: profiled steps (traces, per-module times) and clean ones (step times, CUDA peak memory).

:class:`StepTimer` belongs to one :class:`~precision_audit.capture.session.CaptureSession`: it runs whole
training steps (forward and backward, no optimizer) on the session's model through the session's own reset,
autocast and hooks, and keeps its own timing state. The session's module hooks call :meth:`StepTimer.pre` and
:meth:`StepTimer.post` while a profiled step runs (phase ``"profile"``).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..formats import Format

if TYPE_CHECKING:
    from .session import CaptureSession


class StepTimer:
    """Per format, profiled steps then clean steps on a session's model (see :meth:`run`)."""

    def __init__(self, session: CaptureSession) -> None:
        self.s = session
        self.cuda = session.config.mode == "cuda"
        self._prof_stack: list[tuple[int, Any, Any]] = []
        self._pending_events: list[tuple[int, Any, Any]] = []
        self._step_layer_times: dict[int, float] = {}
        self._layer_times: dict[int, list[float]] = {}

    def run(self, steps: int, traces: bool = True) -> dict[str, list[float]]:
        """Per format, ``steps`` profiled steps, then ``steps`` clean ones (each after one warm-up step).

        Profiled steps run under torch.profiler with module forwards marked ``module::<name>`` in the traces
        and timed (CPU: wall clock; CUDA: a pair of events per module call); they give the traces (Chrome /
        Perfetto JSON, what TensorBoard's profiler plugin reads; kept in the session's ``traces`` for the caller
        to write atomically) and the per-module times. Clean steps run with no profiler, no hooks and no events:
        they give the step times and, on CUDA, the peak memory of a step above what was allocated before it.
        """
        s = self.s
        for fmt in (None, *s.config.formats):
            key = "fp32" if fmt is None else fmt.value
            if fmt is not None and s.runs.get(fmt) and s.runs[fmt].error:
                continue
            self._layer_times = {}
            self._profiled(fmt, key, steps, traces)
            for mid, ts in self._layer_times.items():
                if ts:
                    s._layer(s._modules[mid]).measured_time_s[key] = min(ts) if steps else 0.0
            s.step_times[key] = self._clean_steps(fmt, steps)
        s._reset()
        return s.step_times

    def _profiled(self, fmt: Format | None, key: str, steps: int, traces: bool) -> None:
        """One warm-up and ``steps`` profiled steps; their traces go to the session's ``traces``."""
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        s = self.s
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
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
                    s._reset()
                    s._phase = "profile"
                    try:
                        self.step(fmt)
                        self._sync()
                    finally:
                        s._phase = None
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
                s.traces[f"{key}/{f.name}"] = f.read_bytes()

    def step(self, fmt: Format | None) -> None:
        """One forward and backward, as a training step runs them (FP32: TF32 off on CUDA)."""
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
        """``steps`` uninstrumented steps after a warm-up: no profiler, no module hooks, no CUDA events.

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
                t0 = time.perf_counter()
                self.step(fmt)
                self._sync()
                dt = time.perf_counter() - t0
                if i:  # the warm-up step carries one-time costs (kernel selection, workspaces)
                    times.append(dt)
                    if base is not None:
                        peaks.append(int(torch.cuda.max_memory_allocated(s.config.device)) - base)
        finally:
            s._install_hooks()
        if peaks:
            s.memory.setdefault(key, {})["peak_bytes"] = max(peaks)
        return times

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

