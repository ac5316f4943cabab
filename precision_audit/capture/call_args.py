"""Copies of a module call's arguments for its local re-runs: the objects copied, the tensors shared or cloned.

A module may be called with plain Python objects beside its tensors (Hugging Face's ``Cache``, a config, any
state object) and may change them (a cache appends the call's keys). Each local re-run must see them as the call
did, so the FP32 pass keeps a copy taken before the call and each re-run starts from a fresh copy of that
(capture/reference_pass.py). ``copy.deepcopy`` alone cannot do it: it copies the tensors too, and a tensor that is
not a graph leaf (every activation in a forward with gradients) refuses ``deepcopy``; an object holding one made
the whole audit fail as if the batch were wrong. Here every tensor reachable from the arguments (in containers
and in objects' attributes) is entered in ``deepcopy``'s memo first: shared as it is, or cloned once (for a module
that writes its input in place); modules are shared, never copied.

Example::

    snapshot = copy_arguments((args, kwargs), clone_tensors=False)   # None if an object cannot be copied
"""

from __future__ import annotations

import copy
import types
from typing import Any

import torch

#: The most objects looked through for tensors; past it the arguments are taken as not copyable (None).
MAX_OBJECTS = 100_000

_ATOMIC = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, type,
           types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, range, slice)


def _attributes(obj: Any) -> list[Any]:
    """The values of an object's ``__dict__`` and ``__slots__`` (what ``deepcopy`` copies by default)."""
    out: list[Any] = []
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        out.extend(d.values())
    for cls in type(obj).__mro__:
        for name in cls.__dict__.get("__slots__", ()):
            if isinstance(name, str) and name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                out.append(getattr(obj, name))
    return out


def _shared(value: Any) -> dict[int, Any] | None:
    """{id: object} of every tensor and module reachable from ``value``; None past :data:`MAX_OBJECTS`."""
    found: dict[int, Any] = {}
    seen: set[int] = set()
    stack = [value]
    while stack:
        obj = stack.pop()
        if isinstance(obj, _ATOMIC) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if len(seen) > MAX_OBJECTS:
            return None
        if isinstance(obj, (torch.Tensor, torch.nn.Module)):
            found[id(obj)] = obj
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (tuple, list, set, frozenset)):
            stack.extend(obj)
        else:
            stack.extend(_attributes(obj))
    return found


def copy_arguments(value: Any, *, clone_tensors: bool) -> Any | None:
    """A deep copy of ``value`` (a call's ``(args, kwargs)``) whose tensors are the same tensors
    (``clone_tensors=False``) or detached clones, one per tensor (``True``); modules are the same modules.
    None when something in it cannot be copied."""
    shared = _shared(value)
    if shared is None:
        return None
    memo: dict[int, Any] = {}
    for key, obj in shared.items():
        if clone_tensors and isinstance(obj, torch.Tensor):
            with torch.no_grad():
                memo[key] = obj.detach().clone()
        else:
            memo[key] = obj
    try:
        return copy.deepcopy(value, memo)
    except Exception:  # an object whose own copy protocol fails (a lock, a file handle, ...)
        return None
