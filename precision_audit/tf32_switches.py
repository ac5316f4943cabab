"""Set PyTorch's TF32 switches for a while and put the user's exact settings back (docs/gpu.md, "TF32 switches").

PyTorch 2.13 has two APIs for the same state:

- the legacy one: ``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32`` and
  ``torch.set_float32_matmul_precision("highest" | "high" | "medium")``;
- the newer one: ``torch.backends[.cuda.matmul | .cudnn[.conv | .rnn] | .mkldnn[...]].fp32_precision``
  (``"ieee"``, ``"tf32"``, ``"bf16"`` or ``"none"`` = inherit from the parent).

Once a program has set the newer API, *reading* a legacy flag raises ("mix of the legacy and new APIs"), and
writing ``allow_tf32 = True`` back over a user's ``set_float32_matmul_precision("medium")`` turns it into
``"high"``. So the switches are changed through the API the program is using (legacy when the legacy flags
can be read, the newer one otherwise), and restored through the same API to the exact values saved: the
``float32_matmul_precision`` string (not a boolean), or every ``fp32_precision`` string.

Example::

    with tf32_switches(matmul=False, cudnn=False):  # strict IEEE fp32 inside
        loss = model(x).sum()
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Tf32State", "legacy_flags", "restore", "set_tf32", "snapshot", "tf32_enabled", "tf32_switches"]

# The newer API's nodes, parents before children (a restore sets a parent before its children inherit).
_NEW_API_NODES = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn",
                  "mkldnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")


# The C calls behind each node's ``fp32_precision`` property in torch 2.9-2.13: ((getter backend, op), (setter
# backend, op)). Reading a property costs ~5 us of Python attribute lookups (torch.backends' module wrappers) against
# ~0.2 us for its C call, and the runtime reads the switches around every overridden module's forward and backward
# (docs/policy.md, "The runtime"). torch.backends.mkldnn's property really reads ("mkldnn", "all") and writes
# ("generic", "all"); the table mirrors the properties, whatever they do.
_C_CALLS = {
    "": (("generic", "all"), ("generic", "all")),
    "cuda.matmul": (("cuda", "matmul"), ("cuda", "matmul")),
    "cudnn": (("cuda", "all"), ("cuda", "all")),
    "cudnn.conv": (("cuda", "conv"), ("cuda", "conv")),
    "cudnn.rnn": (("cuda", "rnn"), ("cuda", "rnn")),
    "mkldnn": (("mkldnn", "all"), ("generic", "all")),
    "mkldnn.matmul": (("mkldnn", "matmul"), ("mkldnn", "matmul")),
    "mkldnn.conv": (("mkldnn", "conv"), ("mkldnn", "conv")),
    "mkldnn.rnn": (("mkldnn", "rnn"), ("mkldnn", "rnn")),
}


def _node(path: str) -> Any:
    return functools.reduce(getattr, path.split("."), torch.backends) if path else torch.backends


def _slow_new_api() -> dict[str, str]:
    out = {}
    for path in _NEW_API_NODES:
        try:
            out[path] = str(_node(path).fp32_precision)
        except (AttributeError, RuntimeError):
            continue
    return out


@functools.lru_cache(maxsize=1)
def _fast_nodes() -> tuple[tuple[str, str, str, str, str], ...] | None:
    """(path, getter backend, op, setter backend, op) for every node this torch has, when the C calls read what the
    properties read (checked once); None: go through the properties."""
    get = getattr(torch._C, "_get_fp32_precision_getter", None)
    if get is None or not hasattr(torch._C, "_set_fp32_precision_setter"):
        return None
    nodes = []
    for path, value in _slow_new_api().items():
        (gb, go), (sb, so) = _C_CALLS[path]
        try:
            if get(gb, go) != value:
                return None
        except (RuntimeError, TypeError):
            return None
        nodes.append((path, gb, go, sb, so))
    return tuple(nodes)


def _new_api() -> dict[str, str]:
    """Every ``fp32_precision`` string this torch has (empty before torch 2.9)."""
    nodes = _fast_nodes()
    if nodes is None:
        return _slow_new_api()
    get = torch._C._get_fp32_precision_getter
    return {path: get(gb, go) for path, gb, go, _, _ in nodes}


def _set_new_api(path: str, value: str) -> None:
    nodes = _fast_nodes()
    if nodes is None:
        _node(path).fp32_precision = value
        return
    for p, _, _, sb, so in nodes:
        if p == path:
            torch._C._set_fp32_precision_setter(sb, so, value)
            return
    raise AttributeError(path)


def _legacy_calls() -> tuple[Any, Any, Any] | None:
    """The C calls behind the legacy flags (float32_matmul_precision, cudnn.allow_tf32, cuda.matmul.allow_tf32)."""
    calls = tuple(getattr(torch._C, n, None) for n in ("_get_float32_matmul_precision", "_get_cudnn_allow_tf32",
                                                       "_get_cublas_allow_tf32"))
    return calls if all(c is not None for c in calls) else None  # type: ignore[return-value]


_LEGACY = _legacy_calls()


@dataclass(frozen=True)
class Tf32State:
    """The TF32 settings as found: ``legacy`` is ``(float32_matmul_precision, cudnn.allow_tf32)`` when the
    legacy API can be read (``None`` once the program uses the newer API); ``new`` the ``fp32_precision``
    strings by node (``""`` = ``torch.backends``)."""

    legacy: tuple[str, bool] | None
    new: dict[str, str]


def snapshot() -> Tf32State:
    """The current settings of both APIs (never raises)."""
    try:
        if _LEGACY is not None:
            precision, cudnn, cublas = _LEGACY
            legacy: tuple[str, bool] | None = (precision(), bool(cudnn()))
            cublas()  # raises too when only this flag is mixed
        else:
            legacy = (torch.get_float32_matmul_precision(), bool(torch.backends.cudnn.allow_tf32))
            bool(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:
        legacy = None
    return Tf32State(legacy, _new_api())


def set_tf32(matmul: bool, cudnn: bool, legacy: bool) -> None:
    """Switch TF32 for fp32 matmuls and cuDNN convolutions/RNNs through the legacy flags or the newer API."""
    if legacy:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn
        return
    _set_new_api("cuda.matmul", "tf32" if matmul else "ieee")
    for path in ("cudnn.conv", "cudnn.rnn"):
        _set_new_api(path, "tf32" if cudnn else "ieee")


def restore(state: Tf32State) -> None:
    """Put back exactly the settings ``state`` holds, through the API they were read from."""
    if state.legacy is not None:
        precision, cudnn = state.legacy
        torch.set_float32_matmul_precision(precision)  # "medium" stays "medium"
        torch.backends.cudnn.allow_tf32 = cudnn
        if _new_api() == state.new:
            return
    for path, value in state.new.items():
        try:
            _set_new_api(path, value)
        except (AttributeError, RuntimeError, ValueError):  # a value this node does not take back: leave it
            continue


def legacy_flags() -> tuple[str, bool] | None:
    """``(float32_matmul_precision, cudnn.allow_tf32)`` when the program uses the legacy API (``snapshot().legacy``,
    read in ~1 us), else None."""
    if _LEGACY is None:
        return snapshot().legacy
    precision, cudnn, cublas = _LEGACY
    try:
        flags = precision(), bool(cudnn())
        cublas()  # raises too when only this flag is mixed
    except RuntimeError:
        return None
    return flags


def tf32_enabled() -> tuple[bool, bool]:
    """Whether fp32 matmuls and cuDNN convolutions may use TF32 now: ``(matmul, cudnn_conv)``."""
    flags = legacy_flags()
    if flags is not None:
        return flags[0] != "highest", flags[1]
    state = snapshot()
    if state.legacy is not None:
        return state.legacy[0] != "highest", state.legacy[1]

    def effective(*paths: str) -> str:
        for p in paths:
            v = state.new.get(p, "none")
            if v != "none":
                return v
        return "ieee"

    return effective("cuda.matmul", "") == "tf32", effective("cudnn.conv", "cudnn", "") == "tf32"


@contextlib.contextmanager
def tf32_switches(matmul: bool, cudnn: bool) -> Iterator[None]:
    """TF32 for fp32 matmuls (cuBLAS) and cuDNN convolutions/RNNs set inside; the user's settings after."""
    saved = snapshot()
    set_tf32(matmul, cudnn, legacy=saved.legacy is not None)
    try:
        yield
    finally:
        restore(saved)
