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
open, and keeps the stack of regions on the audited device types.

Regions that turn autocast *on* with their own dtype (``with torch.autocast("cuda", dtype=torch.bfloat16):``
around an attention block in the forward; ``torch.amp.custom_bwd`` restoring, in a backward, the autocast a
custom function's forward ran under) compute in that dtype on a GPU in every pass, the FP32 reference included.
Emulated, entering one turns CPU autocast on with that dtype for its extent, and in both modes a module called
inside one is re-run in that dtype whatever the format: the model pins its precision there, so its local error
is zero in every format, as the GPU's would be.

*Emulated*, the model's questions about CUDA autocast get a GPU's answers too (:class:`CudaQueries`). Code asks
``torch.is_autocast_enabled()`` (no argument: CUDA's) or ``torch.get_autocast_gpu_dtype()`` to cast its own
inputs (Nemotron's LayerNorm casts to the autocast dtype and normalises in it), and ``torch.amp.custom_fwd(
device_type="cuda", cast_inputs=torch.float32)`` asks the same before it casts a custom function's inputs to FP32
and turns autocast off. On a CPU-only build CUDA autocast is always off, so such code took its no-autocast branch
in every pass. While the session is open the CUDA queries answer the emulation's CPU autocast state and dtype,
and ``custom_fwd``'s cast treats the CPU tensors as the device's.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any

import torch
import torch.amp.autocast_mode as _amp_mode
from torch.amp.autocast_mode import autocast as _Autocast

_ACTIVE: UserAutocast | None = None
# a model's autocast region: (enabled, the dtype it computes in when enabled)
UserRegion = tuple[bool, torch.dtype]
# set while torch.autocast's own __enter__/__exit__ run: they save and restore CUDA's real state
_TORCH_OWN = threading.local()


def _in_torch_own() -> bool:
    return getattr(_TORCH_OWN, "depth", 0) > 0


def _own(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` as torch.autocast's own code: the CUDA queries give CUDA's real state."""
    _TORCH_OWN.depth = getattr(_TORCH_OWN, "depth", 0) + 1
    try:
        return fn(*args)
    finally:
        _TORCH_OWN.depth -= 1


class CudaQueries:
    """While entered (emulated sessions only): CUDA autocast queries answer the emulation's state (module
    docstring). Puts the functions and CUDA's real autocast state back on exit."""

    def __init__(self) -> None:
        self._saved: tuple[Any, ...] | None = None
        self._gpu_dtype = hasattr(torch, "get_autocast_gpu_dtype")

    def __enter__(self) -> CudaQueries:
        real_enabled, real_dtype, real_cast = torch.is_autocast_enabled, torch.get_autocast_dtype, _amp_mode._cast
        self._saved = (real_enabled, real_dtype, getattr(torch, "get_autocast_gpu_dtype", None), real_cast,
                       real_enabled("cuda"), real_dtype("cuda"))

        def is_autocast_enabled(*args: Any, **kwargs: Any) -> bool:
            device = args[0] if args else kwargs.get("device_type", "cuda")
            if device == "cuda" and not _in_torch_own():
                return bool(real_enabled("cpu") or real_enabled("cuda"))
            return bool(real_enabled(*args, **kwargs))

        def get_autocast_dtype(*args: Any, **kwargs: Any) -> torch.dtype:
            device = args[0] if args else kwargs.get("device_type")
            if device == "cuda" and not _in_torch_own() and real_enabled("cpu"):
                return real_dtype("cpu")
            return real_dtype(*args, **kwargs)

        def get_autocast_gpu_dtype() -> torch.dtype:
            return get_autocast_dtype("cuda")

        def _cast(value: Any, device_type: str, dtype: torch.dtype) -> Any:
            return real_cast(value, "cpu" if device_type == "cuda" else device_type, dtype)

        torch.is_autocast_enabled = is_autocast_enabled
        torch.get_autocast_dtype = get_autocast_dtype
        if self._gpu_dtype:
            torch.get_autocast_gpu_dtype = get_autocast_gpu_dtype
        _amp_mode._cast = _cast
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is None:
            return
        real_enabled, real_dtype, gpu_dtype, real_cast, cuda_on, cuda_dtype = self._saved
        self._saved = None
        torch.is_autocast_enabled = real_enabled
        torch.get_autocast_dtype = real_dtype
        if self._gpu_dtype:
            torch.get_autocast_gpu_dtype = gpu_dtype
        _amp_mode._cast = real_cast
        # code that saved a query's answer and set it back (torch.set_autocast_enabled(prev)) may have turned
        # CUDA's real flag on: CUDA's state is put back as it was
        torch.set_autocast_enabled("cuda", cuda_on)
        torch.set_autocast_dtype("cuda", cuda_dtype)


class UserAutocast:
    """While entered: the model's autocast regions, as a stack of their ``enabled`` flags (module docstring)."""

    def __init__(self, emulated: bool) -> None:
        self.emulated = emulated
        # the device types whose regions matter: CUDA's, and in emulated mode the CPU's that stands in for it
        self.devices = ("cuda", "cpu") if emulated else ("cuda",)
        # the model's regions open now, innermost last: (enabled, the dtype an enabled one computes in)
        self.stack: list[UserRegion] = []
        self._saved: tuple[Any, Any, Any] | None = None
        self._queries: CudaQueries | None = None

    @property
    def innermost(self) -> UserRegion | None:
        """The innermost region open now, or None."""
        stack = (_ACTIVE or self).stack  # a session inside another reads the outer one's regions
        return stack[-1] if stack else None

    def region(self, fmt_is_autocast: bool, inner: UserRegion | None) -> contextlib.AbstractContextManager[Any]:
        """For a re-run of a module called inside the model's region ``inner``, the autocast of that call: off
        inside an "off" region (nothing to turn off when the format is no autocast), the region's own dtype
        inside an "on" one, whatever the format (the model computes in it in every pass, the FP32 one included)."""
        device = "cpu" if self.emulated else "cuda"
        if inner is None or (not inner[0] and not fmt_is_autocast):
            return contextlib.nullcontext()
        if not inner[0]:
            return torch.autocast(device, enabled=False)
        return torch.autocast(device, dtype=inner[1], cache_enabled=False)

    def __enter__(self) -> UserAutocast:
        global _ACTIVE
        if _ACTIVE is not None:  # a session inside a session (the distributed worker's): the outer one tracks
            return self
        self._saved = (_Autocast.__init__, _Autocast.__enter__, _Autocast.__exit__)
        init, enter, exit_ = self._saved

        def patched_init(a, device_type, dtype=None, enabled=True, cache_enabled=None):
            a._pa_requested = (device_type, bool(enabled), dtype)
            tracker = _ACTIVE
            with warnings.catch_warnings():
                if tracker is not None and tracker.emulated and device_type == "cuda":
                    # "CUDA is not available ... Disabling autocast": the emulation stands in for it
                    warnings.simplefilter("ignore", UserWarning)
                _own(lambda: init(a, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled))

        def patched_enter(a):
            out = _own(enter, a)
            tracker, req = _ACTIVE, getattr(a, "_pa_requested", None)
            a._pa_inner = None
            a._pa_tracked = False
            if tracker is not None and req is not None and req[0] in tracker.devices:
                a._pa_tracked = True
                dtype = req[2] if req[2] is not None else _own(torch.get_autocast_dtype, req[0])
                tracker.stack.append((req[1], dtype))
                inner = None
                if tracker.emulated and req[0] == "cuda" and not req[1] and torch.is_autocast_enabled("cpu"):
                    inner = torch.autocast("cpu", enabled=False)
                elif tracker.emulated and req[0] == "cuda" and req[1]:
                    # the model's own "on" region (or custom_bwd restoring, in a backward, the autocast its
                    # custom function's forward ran under): CUDA autocast at that dtype, emulated
                    inner = torch.autocast("cpu", dtype=dtype, cache_enabled=False)
                if inner is not None:
                    _own(enter, inner)
                    a._pa_inner = inner
            return out

        def patched_exit(a, *exc):
            if getattr(a, "_pa_tracked", False):
                a._pa_tracked = False
                if _ACTIVE is not None and _ACTIVE.stack:
                    _ACTIVE.stack.pop()
                if a._pa_inner is not None:
                    _own(exit_, a._pa_inner, *exc)
                    a._pa_inner = None
            return _own(exit_, a, *exc)

        _Autocast.__init__ = patched_init  # type: ignore[method-assign]
        _Autocast.__enter__ = patched_enter  # type: ignore[method-assign]
        _Autocast.__exit__ = patched_exit  # type: ignore[method-assign]
        _ACTIVE = self
        if self.emulated:
            self._queries = CudaQueries().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        if self._saved is None:
            return
        if self._queries is not None:
            self._queries.__exit__(*exc)
            self._queries = None
        _Autocast.__init__, _Autocast.__enter__, _Autocast.__exit__ = self._saved  # type: ignore[method-assign]
        self._saved = None
        _ACTIVE = None
        self.stack.clear()
