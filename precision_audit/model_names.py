"""A model's modules by name, and its identity: the names every stage keys its per-module records by
(``named_modules``, training wrappers made transparent), and the fingerprint a policy carries to check that it
is applied to the model it was made for (docs/policy.md, "Fingerprint").

Used by every stage that walks a model (capture, analysis, planning, fp8, the runtime) and by the policy record;
it imports only torch and errors.py.

Example::

    fingerprint(nn.Sequential(nn.Linear(4, 2)))   # ("sha256:...", 2)
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator, Mapping

import torch

from .errors import PolicyError


def _wrapped_inner(m: torch.nn.Module) -> torch.nn.Module | None:
    """The module a training wrapper holds, or None: torch.compile's OptimizedModule, DDP, DataParallel."""
    if type(m).__name__ == "OptimizedModule":  # (a TorchScript module's _modules has no .get: not asked)
        inner = m._modules.get("_orig_mod")
        if inner is not None:
            return inner
    if isinstance(m, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return m.module
    return None


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside torch.compile / DistributedDataParallel / DataParallel wrappers (any nesting)."""
    if not isinstance(model, torch.nn.Module):
        raise PolicyError("a policy applies to a torch.nn.Module", found=type(model).__name__)
    while (inner := _wrapped_inner(model)) is not None:
        model = inner
    return model


def named_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``model.named_modules()`` with training wrappers made transparent.

    For a plain model this is exactly ``named_modules()`` (same names, same order, shared modules once).
    A wrapper (``torch.compile``'s OptimizedModule, DDP, DataParallel) at the root or anywhere inside is
    replaced by the module it wraps under the wrapper's own name, so ``ddp_model`` yields ``"encoder"``, not
    ``"module.encoder"``, and ``model.block = torch.compile(model.block)`` keeps ``"block.fc"``.
    """
    memo: set[int] = set()

    def walk(m: torch.nn.Module, prefix: str) -> Iterator[tuple[str, torch.nn.Module]]:
        m = unwrap_model(m)
        if id(m) in memo:
            return
        memo.add(id(m))
        yield prefix, m
        for name, child in m._modules.items():
            if child is not None:
                yield from walk(child, f"{prefix}.{name}" if prefix else name)

    yield from walk(model, "")


def _type_name(m: torch.nn.Module) -> str:
    cls = type(m)
    # FSDP2's fully_shard swaps the class for a generated ``FSDP<Name>(FSDPModule, <Name>)``: use <Name>.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp_module = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    if fsdp_module is not None and isinstance(m, fsdp_module) and len(cls.__bases__) == 2:
        cls = cls.__bases__[1]
    return cls.__name__


def _params_signature(m: torch.nn.Module) -> str:
    return ",".join(f"{pn}:{'x'.join(map(str, p.shape))}" for pn, p in m.named_parameters(recurse=False))


def model_layout(model: torch.nn.Module) -> dict[str, str]:
    """``{module name: "Type[param:shape,...]"}`` for every module, in ``named_modules()`` order.

    This is what the fingerprint hashes; stored in policy.json as ``model.layout`` it lets
    :meth:`Policy.check_model` name the modules that differ. Example::

        model_layout(nn.Sequential(nn.Linear(4, 2)))
        # {"": "Sequential[]", "0": "Linear[weight:2x4,bias:2]"}
    """
    return {name: f"{_type_name(m)}[{_params_signature(m)}]" for name, m in named_modules(model)}


def layout_fingerprint(layout: Mapping[str, str]) -> str:
    """The fingerprint of a :func:`model_layout` (what :func:`fingerprint` returns first)."""
    h = hashlib.sha256()
    for name, entry in layout.items():
        type_name, _, rest = entry.partition("[")
        # surrogatepass: a name holding a lone surrogate (add_module takes any string, a policy.json any \ud800
        # escape) hashes instead of raising UnicodeEncodeError; every other string encodes exactly as UTF-8
        h.update(f"{name}\t{type_name}\t{rest[:-1] if rest.endswith(']') else rest}\n".encode("utf-8",
                                                                                             "surrogatepass"))
    return "sha256:" + h.hexdigest()


def fingerprint(model: torch.nn.Module) -> tuple[str, int]:
    """``("sha256:<hex>", module_count)`` over every module's name, type and own parameter shapes.

    Two models with the same architecture and parameter shapes share a fingerprint whatever their weights;
    torch.compile / DDP / DataParallel wrappers do not change it (see :func:`named_modules`).
    """
    layout = model_layout(model)
    return layout_fingerprint(layout), len(layout)

