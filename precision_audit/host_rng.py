"""Python's and NumPy's global random generators, which models draw from in their forward.

wav2vec2, HuBERT and their kin draw their SpecAugment time masks and their layer drop from ``np.random``
(transformers' ``_compute_mask_indices``, ``np.random.random()`` per layer). A capture session reseeds torch's
generator for every pass and puts it back around every re-run of a module (capture/session.py,
capture/reference_pass.py); these two generators go with it, so that every pass and every re-run draws the same
masks as the FP32 pass, and the user's generators are as they were when the session ends (docs/memory.md).
NumPy's new-style ``Generator`` objects a model holds are not covered; NumPy is only touched when it is imported.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

HostRng = tuple[Any, Any]  # (random.getstate(), numpy.random.get_state() or None)


def _numpy() -> Any:
    return sys.modules.get("numpy")


def state() -> HostRng:
    np = _numpy()
    return random.getstate(), (np.random.get_state() if np is not None else None)


def set_state(s: HostRng) -> None:
    random.setstate(s[0])
    np = _numpy()
    if s[1] is not None and np is not None:
        np.random.set_state(s[1])


def same(a: HostRng, b: HostRng) -> bool:
    """Whether two states are the same (NumPy's holds an array: compared by value)."""
    if a[0] != b[0] or (a[1] is None) != (b[1] is None):
        return False
    if a[1] is None:
        return True
    np = _numpy()
    return a[1][0] == b[1][0] and bool(np.array_equal(a[1][1], b[1][1])) and tuple(a[1][2:]) == tuple(b[1][2:])


def seed(value: int) -> None:
    """Seed both, as ``torch.manual_seed`` seeds torch's, at the start of every pass."""
    random.seed(value)
    np = _numpy()
    if np is not None:
        np.random.seed(value % 2**32)


@contextlib.contextmanager
def fork() -> Iterator[None]:
    """Inside: the generators may be reseeded and drawn from; on exit they are as they were."""
    saved = state()
    try:
        yield
    finally:
        set_state(saved)
