"""Random draws (dropout masks) taken once, in the FP32 reference pass, and replayed in the other passes.

On CUDA, seeding every pass identically does not give the same dropout masks in every format: the
vectorised dropout kernel's unroll width, so the RNG offset each element gets, depends on the dtype, and
fused attention picks a different kernel (with its own draws) per dtype. Train-mode errors would then be
dominated by mask differences. So in cuda mode (docs/gpu.md, "Dropout in the numerics passes"):

- the reference pass records the result of every random op (ops tagged ``nondeterministic_seeded``:
  ``native_dropout``'s mask, ``bernoulli_``, ``rand``, ...), in call order;
- the format passes, each module's local re-runs and the plan verification replay them by position: the
  op still runs (so shapes, dtypes and devices are the pass's own), then its random part is overwritten
  with the reference's draw. ``native_dropout`` is recomputed from the recorded mask as CUDA's kernel
  computes it (``x * mask * 1/(1-p)`` in fp32, rounded once to the input's dtype);
- attention with dropout (``scaled_dot_product_attention`` with ``dropout_p > 0``) runs through the math
  backend in these passes, whose dropout is a replayable op; attention without dropout keeps its kernels.
  The timed steps run the user's kernels untouched.

A draw whose shape differs from the reference's at that position is drawn live and counted
(``ReplayRandom.mismatches``); the audit warns about it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_SEEDED = torch.Tag.nondeterministic_seeded


def _is_random(func: Any) -> bool:
    return _SEEDED in getattr(func, "tags", ())


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for x in out:
            if isinstance(x, torch.Tensor):
                return x
    return None


class RandomDraws:
    """The reference pass's draws, in call order: ``(op, tensor)``; for ``native_dropout`` the mask."""

    def __init__(self) -> None:
        self.draws: list[tuple[Any, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self.draws)

    def clear(self) -> None:
        self.draws.clear()


class RecordRandom(TorchDispatchMode):
    """Records the result of every random op into ``draws``."""

    def __init__(self, draws: RandomDraws) -> None:
        super().__init__()
        self.draws = draws

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _is_random(func):
            if func is _aten.native_dropout.default:
                kept = out[1]
            else:
                kept = _first_tensor(out)
            if kept is not None:
                self.draws.draws.append((func, kept.detach().clone()))
        return out


class ReplayRandom(TorchDispatchMode):
    """Replays ``draws`` from position ``start``: each random op gets the reference's draw at its position."""

    def __init__(self, draws: RandomDraws, start: int = 0) -> None:
        super().__init__()
        self.draws = draws
        self.position = start
        self.replayed = 0
        self.mismatches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not _is_random(func):
            return out
        k = self.position
        self.position += 1
        rec = self.draws.draws[k] if k < len(self.draws.draws) else None
        if func is _aten.native_dropout.default:
            x, mask = args[0], out[1]
            p = float(args[1])
            train = args[2] if len(args) > 2 else kwargs.get("train")
            if rec is None or rec[0] is not func or rec[1].shape != mask.shape or train is False:
                self.mismatches += train is not False
                return out
            keep = rec[1].to(mask.device, mask.dtype)
            scale = 1.0 / (1.0 - p) if p < 1 else 0.0
            y = (x.float() * keep * scale).to(x.dtype)  # CUDA's kernel: fp32 math, rounded once
            return y, keep
        target = _first_tensor(out)
        if rec is None or rec[0] is not func or target is None or rec[1].shape != target.shape:
            self.mismatches += 1
            return out
        target.copy_(rec[1])  # in place ops mutate args[0], which is target; the others return it
        self.replayed += 1
        return out


class _MathAttentionForDropout(TorchFunctionMode):
    """``scaled_dot_product_attention`` with ``dropout_p > 0`` through the math backend (replayable dropout)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "scaled_dot_product_attention":
            p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            if p:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel([SDPBackend.MATH]):
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def recording(draws: RandomDraws) -> Iterator[None]:
    """The reference pass: attention with dropout through the math backend, every draw recorded."""
    with _MathAttentionForDropout(), RecordRandom(draws):
        yield


@contextlib.contextmanager
def replaying(draws: RandomDraws, start: int = 0) -> Iterator[ReplayRandom]:
    """A pass that replays the reference's draws from ``start``."""
    mode = ReplayRandom(draws, start)
    with _MathAttentionForDropout(), mode:
        yield mode
