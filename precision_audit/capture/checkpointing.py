"""Reentrant activation checkpointing, run as the non-reentrant kind while the audit's passes run.

``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`` — what Hugging Face's
``gradient_checkpointing_enable()`` asks for unless told otherwise — runs its segment under ``no_grad`` and
recomputes it inside the backward with a backward of its own. The audit reads dL/dy of every module output
through tensor hooks registered when the forward returns (capture/output_grads.py): inside a reentrant segment
there is no such output (nothing requires grad), so every module in it had no gradient ranges and no loss
impact, silently.

The non-reentrant kind computes the same values (the same forward, recomputed from saved inputs when the backward
unpacks them, with the same random state), with outputs that require grad: the hooks fire as without
checkpointing. :class:`NonReentrantCheckpoints` makes ``checkpoint`` take that path while the session is open (it
replaces ``torch.utils.checkpoint.CheckpointFunction``, which ``checkpoint`` looks up when called, so a
``functools.partial(checkpoint, use_reentrant=True)`` made before the audit is covered too) and puts it back
after. A segment none of whose inputs requires grad keeps the reentrant kind: there its parameters get no
gradient in training either (PyTorch warns), and the audit measures what training does.
tests/capture/test_checkpointing.py compares every figure with and without checkpointing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint as _ckpt


class _AsNonReentrant:
    def __init__(self, original: Any) -> None:
        self.original = original

    def apply(self, function, preserve_rng_state, *args):
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return _ckpt.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)
        return self.original.apply(function, preserve_rng_state, *args)


class NonReentrantCheckpoints:
    """While entered, reentrant ``torch.utils.checkpoint`` segments run as non-reentrant ones (module docstring)."""

    def __init__(self) -> None:
        self._saved: Any = None

    def __enter__(self) -> NonReentrantCheckpoints:
        current = _ckpt.CheckpointFunction
        if not isinstance(current, _AsNonReentrant):  # a session inside another: the outer one's stays
            self._saved = current
            _ckpt.CheckpointFunction = _AsNonReentrant(current)  # type: ignore[misc,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            _ckpt.CheckpointFunction = self._saved  # type: ignore[misc]
            self._saved = None
