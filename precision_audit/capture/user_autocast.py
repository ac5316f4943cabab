"""The model's own ``torch.autocast(..., enabled=False)`` regions during the audit's passes.

Models keep numerically sensitive parts in FP32 by turning autocast off around them (a router, a loss head,
rotary embeddings)::

    with torch.autocast("cuda", enabled=False):
        logits = self.router(x.float())

Two things follow for the audit (docs/emulation.md, "The model's own autocast regions"):

- *Emulated*, the passes stand CPU autocast in for CUDA autocast. A region written for ``"cuda"`` (or through
  ``torch.cuda.amp.autocast``) leaves CPU autocast on, so the region would run in low precision where a GPU runs
  it in FP32. While the audit runs, entering such a region also turns CPU autocast off for its extent. (A region
  on the tensors' own device type, ``torch.autocast(x.device.type, enabled=False)``, already does.)
- Each module is re-run alone per format on its FP32 inputs (its local error). A module called inside such a
  region is re-run with autocast off as well, as the model runs it: its local error is then FP32's own, zero,
  instead of the low-precision error of a computation the model never makes.

:class:`UserAutocast` patches ``torch.autocast``'s ``__init__`` (to know the ``enabled`` the model asked for: on
a CPU-only build ``torch.autocast("cuda")`` turns itself off), ``__enter__`` and ``__exit__`` while the session is
open, and keeps the stack of regions on the audited device types. Regions that turn autocast *on* with their own
dtype are tracked (they end an enclosing "off") but not emulated.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.amp.autocast_mode import autocast as _Autocast

_ACTIVE: UserAutocast | None = None


class UserAutocast:
    """While entered: the model's autocast regions, as a stack of their ``enabled`` flags (module docstring)."""

    def __init__(self, emulated: bool) -> None:
        self.emulated = emulated
        # the device types whose regions matter: CUDA's, and in emulated mode the CPU's that stands in for it
        self.devices = ("cuda", "cpu") if emulated else ("cuda",)
        self.stack: list[bool] = []
        self._saved: tuple[Any, Any, Any] | None = None

    @property
    def off(self) -> bool:
        """Whether the innermost region open now turns autocast off."""
        stack = (_ACTIVE or self).stack  # a session inside another reads the outer one's regions
        return bool(stack) and not stack[-1]

    def region(self, fmt_is_autocast: bool) -> contextlib.AbstractContextManager[Any]:
        """For a re-run of a module called inside an "off" region: autocast off, as in that call."""
        if not fmt_is_autocast:
            return contextlib.nullcontext()
        return torch.autocast("cpu" if self.emulated else "cuda", enabled=False)

    def __enter__(self) -> UserAutocast:
        global _ACTIVE
        if _ACTIVE is not None:  # a session inside a session (the distributed worker's): the outer one tracks
            return self
        self._saved = (_Autocast.__init__, _Autocast.__enter__, _Autocast.__exit__)
        init, enter, exit_ = self._saved

        def patched_init(a, device_type, dtype=None, enabled=True, cache_enabled=None):
            a._pa_requested = (device_type, bool(enabled))
            init(a, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

        def patched_enter(a):
            out = enter(a)
            tracker, req = _ACTIVE, getattr(a, "_pa_requested", None)
            a._pa_inner = None
            a._pa_tracked = False
            if tracker is not None and req is not None and req[0] in tracker.devices:
                a._pa_tracked = True
                tracker.stack.append(req[1])
                if tracker.emulated and req[0] == "cuda" and not req[1] and torch.is_autocast_enabled("cpu"):
                    inner = torch.autocast("cpu", enabled=False)
                    enter(inner)
                    a._pa_inner = inner
            return out

        def patched_exit(a, *exc):
            if getattr(a, "_pa_tracked", False):
                a._pa_tracked = False
                if _ACTIVE is not None and _ACTIVE.stack:
                    _ACTIVE.stack.pop()
                if a._pa_inner is not None:
                    exit_(a._pa_inner, *exc)
                    a._pa_inner = None
            return exit_(a, *exc)

        _Autocast.__init__ = patched_init  # type: ignore[method-assign]
        _Autocast.__enter__ = patched_enter  # type: ignore[method-assign]
        _Autocast.__exit__ = patched_exit  # type: ignore[method-assign]
        _ACTIVE = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        if self._saved is None:
            return
        _Autocast.__init__, _Autocast.__enter__, _Autocast.__exit__ = self._saved  # type: ignore[method-assign]
        self._saved = None
        _ACTIVE = None
        self.stack.clear()
