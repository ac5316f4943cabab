"""The GEMM timer's protocol (analysis/gemm_bench.py) against a model of a CUDA stream: a host that takes time to
launch each kernel, a GPU that runs them in order, and events that fire when the GPU reaches them."""

from __future__ import annotations

import pytest
import torch

from precision_audit.analysis import gemm_bench

LAUNCH_S = 20e-6  # host time to launch one kernel
KERNEL_S = 50e-6  # GPU time of one kernel (longer than its launch: back-to-back calls keep the GPU busy)


class VirtualStream:
    """One CUDA stream in virtual time: ``host`` is the CPU's clock, ``gpu_free`` when the GPU's queue drains."""

    def __init__(self) -> None:
        self.host = 0.0
        self.gpu_free = 0.0
        self.launches = 0

    def launch(self, seconds: float) -> None:
        self.host += LAUNCH_S
        self.gpu_free = max(self.host, self.gpu_free) + seconds
        self.launches += 1

    def event_class(self):
        stream = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.t: float | None = None

            def record(self, s=None) -> None:  # fires once the GPU has done everything queued before it
                self.t = max(stream.host, stream.gpu_free)

            def synchronize(self) -> None:
                assert self.t is not None
                stream.host = max(stream.host, self.t)

            def elapsed_time(self, end) -> float:
                return (end.t - self.t) * 1e3

        return Event


def test_a_kernel_is_timed_without_the_hosts_launch_gap(monkeypatch):
    """An event pair around one call on an idle GPU reads launch + kernel (70 µs for a 50 µs kernel); the timer
    queues its start behind a running call and spreads what is left over the calls it times."""
    stream = VirtualStream()
    monkeypatch.setattr(torch.cuda, "Event", stream.event_class())
    t = gemm_bench._time_callable(lambda: stream.launch(KERNEL_S))
    assert t == pytest.approx(KERNEL_S, rel=0.02), f"timed {t * 1e6:.1f} µs for a {KERNEL_S * 1e6:.0f} µs kernel"
    assert stream.launches >= gemm_bench.CALLS_PER_TIMING * 5, "several calls per event pair"
