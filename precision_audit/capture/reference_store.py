"""Where the FP32 reference's kept tensors live: on the host when the audit runs on a GPU (docs/memory.md).

The format passes compare each module's output with the reference pass's FP32 output of the same call, and the
reference backward multiplies dL/dy by each format's local-error difference y_p - y (kept in bf16). Kept on the
GPU, those are one more copy of every activation (and half of one per format) on top of what a training step
holds — the reason an audit could not fit a model that trains in most of the GPU's memory.

On a CUDA device they are copied to pinned host memory as they are made (``non_blocking``: the copy is queued
on the current stream, so the device tensor can be freed at once and nothing waits), and each one is copied
back to the device only for the one statistic that reads it, then dropped. The figures are the same: the
copies are exact and every statistic is still computed on the device, from the same values. On a CPU device
the tensors stay where they are (a copy to the host would be a second copy in the same memory).
"""

from __future__ import annotations

import torch


class ReferenceStore:
    """Keeps reference tensors for later comparison, on the host when ``device`` is a CUDA device."""

    def __init__(self, device: str | torch.device) -> None:
        self.offload = torch.device(device).type == "cuda"
        self._pinned = True  # cleared when no pinned-memory allocator exists (a fake CUDA device in tests)

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` (detached) to compare against later: on the host when offloading, else a clone."""
        t = t.detach()
        return self.stash(t) if self.offload else t.clone()

    def stash(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` kept for later: a host copy when offloading, else ``t`` itself (the caller made it)."""
        if not self.offload:
            return t
        if self._pinned:
            try:
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            except RuntimeError:  # no pinned allocator: a pageable copy (synchronous, same values)
                self._pinned = False
            else:
                return host.copy_(t, non_blocking=True)
        return t.to("cpu", copy=True)

    def on(self, r: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``r`` on ``like``'s device, for one statistic (a copy when it was offloaded; ``r`` itself otherwise)."""
        if r.device == like.device:
            return r
        return r.to(like.device, non_blocking=True)
