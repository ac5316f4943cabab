"""Reseeds from the OS inside a forward, made reproducible for the audit's passes.

A model that calls ``torch.seed()`` in its forward (Hugging Face's Reformer does, once per layer and forward, so
that its reversible backward can replay the layer's dropout) reseeds torch's generator with a number from the OS:
every pass then draws different dropout masks, and no two passes can be compared. A random-init Reformer's output
moved by 38% between two FP32 forwards with the same seed, and the audit reported "FP32 is not reproducible".

While a capture session (or verify's arms) runs, ``torch.seed()`` takes its seed from torch's generator instead: a
63-bit draw, a function of the generator's state, which the session sets before every pass and puts back around
every re-run. So every pass draws the same masks as the FP32 pass, as with any other draw; what the model does
with the seed is unchanged. ``calls`` counts the reseeds, for the audit's warnings. (``Generator.seed()`` on a
CUDA generator object cannot be replaced; in cuda mode the passes replay the reference's draws instead,
capture/rng_replay.py.)
"""

from __future__ import annotations

from types import TracebackType

import torch

_SEED_MAX = 2**63 - 1


class ReproducibleReseeds:
    """Context manager: ``torch.seed`` / ``torch.random.seed`` draw their seed from the generator while it is on."""

    def __init__(self) -> None:
        self.calls = 0
        self._saved: tuple = ()

    def _seed(self) -> int:
        self.calls += 1
        s = int(torch.randint(0, _SEED_MAX, (), dtype=torch.int64))
        torch.manual_seed(s)  # every device's generator, as torch.seed() seeds them all
        return s

    def __enter__(self) -> ReproducibleReseeds:
        self._saved = (torch.seed, torch.random.seed)
        torch.seed = torch.random.seed = self._seed
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        torch.seed, torch.random.seed = self._saved

    def warning(self) -> list[str]:
        if not self.calls:
            return []
        return [f"the model reseeds torch's generator from the OS in its forward (torch.seed(), {self.calls} "
                "call(s) in the audit's passes), which would give every pass other dropout masks: during the audit "
                "each reseed took its seed from the generator instead, so that every pass drew the same masks "
                "(precision_audit/capture/reseeds.py); the model's randomness is otherwise as in training"]
