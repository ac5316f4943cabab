"""The policy under FSDP2 (``fully_shard``): which units, with which ``MixedPrecisionPolicy`` (docs/distributed.md,
"The runtime across ranks").

Under FSDP2 a unit's parameters are all-gathered in its ``MixedPrecisionPolicy.param_dtype``, once for the whole
unit, so a module that the policy keeps in another format than its surroundings must be a unit of its own: an fp32
module inside a unit gathered in bf16 would compute from bf16-rounded weights, whatever autocast does.
:func:`shard_fsdp2` shards a model so that this holds; :func:`unit_conflicts` finds the modules for which it does
not (apply_policy refuses such a model, and the adaptive controller warns when a promotion meets one).

Autocast inside the units is :func:`precision_audit.apply_policy`'s per-module forwards plus
:func:`precision_audit.autocast`, exactly as without FSDP. ``cast_forward_inputs`` is off: a unit's inputs stay in
the dtype the previous module produced, as under autocast alone, and autocast casts them at each matmul.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, cast

import torch

from ..errors import PolicyError
from ..formats import LOW_PRECISION_DTYPES
from ..policy import Policy, named_modules, unwrap_model

log = logging.getLogger(__name__)

PARAM_DTYPES = ("fp32", "policy")


def _dtype(fmt: str) -> torch.dtype | None:
    """The low-precision dtype of a format name (None for fp32 / tf32)."""
    return cast("dict[str, torch.dtype]", LOW_PRECISION_DTYPES).get(fmt)


def _fsdp_module_class() -> Any:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return None
    return FSDPModule


def is_fsdp2(model: torch.nn.Module) -> bool:
    """Whether any module of ``model`` (wrappers looked through) was sharded with ``fully_shard``."""
    cls = _fsdp_module_class()
    return cls is not None and any(isinstance(m, cls) for _, m in named_modules(unwrap_model(model)))


def _unit_param_dtype(module: torch.nn.Module) -> torch.dtype | None:
    state = module._get_fsdp_state()  # type: ignore[operator]
    mp = getattr(state, "_mp_policy", None)
    return getattr(mp, "param_dtype", None) if mp is not None else None


def unit_conflicts(model: torch.nn.Module, policy: Policy) -> list[str]:
    """Modules with parameters whose FSDP2 unit gathers them in a dtype the policy's format for them cannot use.

    A unit gathered in fp32 (``param_dtype`` None or float32) suits every format (autocast casts at each op); a unit
    gathered in a low-precision dtype suits only modules in that very format.
    """
    cls = _fsdp_module_class()
    if cls is None:
        return []
    root = unwrap_model(model)
    out = []

    def walk(m: torch.nn.Module, prefix: str, unit_dtype: torch.dtype | None) -> None:
        m = unwrap_model(m)
        if isinstance(m, cls):
            unit_dtype = _unit_param_dtype(m)
        if unit_dtype not in (None, torch.float32) and any(True for _ in m.parameters(recurse=False)):
            fmt = policy.effective_format(prefix)
            if _dtype(fmt) != unit_dtype:
                out.append(f"{prefix or '(root)'} ({fmt}, gathered in {str(unit_dtype).replace('torch.', '')})")
        for name, child in m._modules.items():
            if child is not None:
                walk(child, f"{prefix}.{name}" if prefix else name, unit_dtype)

    walk(root, "", None)
    return out


def check_units(model: torch.nn.Module, policy: Policy) -> None:
    """Refuse a sharded model whose units would feed a module parameters in a dtype its format cannot use."""
    bad = unit_conflicts(model, policy)
    if bad:
        shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise PolicyError("under FSDP2 these modules would compute from parameters gathered in another format than "
                          f"the policy's for them: {shown}",
                          hint="shard with precision_audit.shard_fsdp2(model, policy) (each module in another "
                               "format becomes its own unit), or fully_shard without param_dtype")


def _own_unit_names(root: torch.nn.Module, policy: Policy) -> list[str]:
    """Modules with parameters whose format's dtype differs from their parent's: each needs its own unit."""
    names = []
    for name, m in named_modules(root):
        if not name or not any(True for _ in m.parameters()):
            continue
        parent = name.rpartition(".")[0]
        if _dtype(policy.effective_format(name)) != _dtype(
                policy.effective_format(parent)):
            names.append(name)
    return names


def shard_fsdp2(model: torch.nn.Module, policy: Policy, *, units: Iterable[str] | None = None,
                param_dtype: str = "fp32", mesh: Any = None, **fully_shard_kwargs: Any) -> torch.nn.Module:
    """``fully_shard`` ``model`` for ``policy`` (in place; returns ``model``), then apply the policy with
    :func:`precision_audit.apply_policy` and train under :func:`precision_audit.autocast` as without FSDP.

    Units, innermost first: ``units`` (names; default: the children of the largest ``nn.ModuleList``, the
    repeated blocks), then, with ``param_dtype="policy"``, every module with parameters that the policy keeps in
    another format than its parent, then the root. ``param_dtype``:

    - ``"fp32"`` (default): every unit gathers fp32 parameters and reduces fp32 gradients; autocast casts at each
      op, exactly as the audit measured (and the adaptive controller's promotions take full effect);
    - ``"policy"``: each unit gathers its parameters in its format's dtype (``MixedPrecisionPolicy(param_dtype=
      bf16|fp16, reduce_dtype=float32)``; fp32 for fp32/tf32 modules), halving all-gather traffic and unsharded
      memory. Ops that autocast keeps in fp32 (norms, embeddings) then see low-precision-rounded parameters.

    Example::

        pa.shard_fsdp2(model, policy)
        handle = pa.apply_policy(model, policy)
        ctl = pa.controller(model, optimizer, policy)
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if param_dtype not in PARAM_DTYPES:
        raise PolicyError("shard_fsdp2's param_dtype must be 'fp32' or 'policy'", found=repr(param_dtype),
                          choices=PARAM_DTYPES)
    root = unwrap_model(model)
    policy.check_model(root)
    if "mp_policy" in fully_shard_kwargs:
        raise PolicyError("shard_fsdp2 sets each unit's mp_policy from the policy", found="mp_policy=...",
                          hint="choose param_dtype='fp32' or 'policy' instead")
    modules = dict(named_modules(root))
    if units is None:
        best = None
        for name, m in modules.items():
            if isinstance(m, torch.nn.ModuleList) and len(m) and (best is None or len(m) > len(modules[best])):  # type: ignore[arg-type]
                best = name
        chosen = ([f"{best}.{i}" if best else str(i) for i in range(len(modules[best]))]  # type: ignore[arg-type]
                  if best is not None else [])
    else:
        chosen = list(units)
        missing = [n for n in chosen if n not in modules]
        if missing:
            raise PolicyError(f"shard_fsdp2: no module named {', '.join(map(repr, missing[:6]))} in the model",
                              hint="units are names from model.named_modules()")
    if param_dtype == "policy":
        chosen += [n for n in _own_unit_names(root, policy) if n not in chosen]
    chosen = [n for n in chosen if n]

    def mp(name: str) -> Any:
        if param_dtype == "fp32":
            return MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
        return MixedPrecisionPolicy(param_dtype=_dtype(policy.effective_format(name)),
                                    reduce_dtype=torch.float32, cast_forward_inputs=False)

    for name in sorted(chosen, key=lambda n: -n.count(".")):
        fully_shard(modules[name], mesh=mesh, mp_policy=mp(name), **fully_shard_kwargs)
    fully_shard(root, mesh=mesh, mp_policy=mp(""), **fully_shard_kwargs)
    log.info("sharded with FSDP2: %d unit(s) and the root, parameters gathered in %s", len(chosen),
             "fp32" if param_dtype == "fp32" else "each unit's format")
    return model
