"""policy.json: a versioned, validated per-module precision plan (docs/policy.md).

This module imports nothing from the audit machinery nor from the runtime: the record is data. The runtime
(:mod:`precision_audit.runtime`) imports it, never the other way round (docs/architecture.md); applying a
policy is ``precision_audit.apply_policy(model, policy)`` and its siblings (docs/policy.md, "The runtime").

Example::

    from precision_audit import load_policy
    policy = load_policy("audit/policy.json")
    policy.format_for("lm_head")      # "fp32"
    policy.check_model(model)         # PolicyError listing the differing modules if it is another model
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import math
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import PolicyError
from ..formats import ALL_FORMATS, AUTOCAST_FORMATS, names

POLICY_SCHEMA_ID = "precision-audit/policy"
#: The newest policy version this code writes and reads. Versions 1..POLICY_VERSION load (docs/policy.md).
POLICY_VERSION = 1
SUPPORTED_VERSIONS = tuple(range(1, POLICY_VERSION + 1))
POLICY_FORMATS = names(ALL_FORMATS)
#: The formats :func:`precision_audit.apply_policy` can put a module in (autocast has no fp8).
RUNTIME_FORMATS = names(AUTOCAST_FORMATS)
#: The runtime methods the record had before it became data only, and what replaced each of them.
_MOVED_TO_RUNTIME = {
    "apply": "precision_audit.apply_policy(model, policy, device_type=None, strict=True)",
    "autocast": "precision_audit.autocast(policy, device_type='cuda', enabled=True)",
    "grad_scaler": "precision_audit.grad_scaler(policy, device='cuda')",
    "controller": "precision_audit.controller(model, optimizer, policy, ...)",
}

# The top-level keys version 1 defines; any other key is kept as-is in ``Policy.extra`` and written back.
_KNOWN_KEYS = ("schema", "version", "tool", "model", "target", "default_format", "modules", "loss_scaling", "tf32")
_LIST_LIMIT = 12
_FINGERPRINT = re.compile(r"sha256:[0-9a-f]{64}")  # names listed per category in a fingerprint-mismatch message


# -- model identity --------------------------------------------------------------------------------------------

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


def _layout_fingerprint(layout: Mapping[str, str]) -> str:
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
    return _layout_fingerprint(layout), len(layout)


def _layout_diff(expected: Mapping[str, str], actual: Mapping[str, str]) -> tuple[list[str], list[str], list[str]]:
    """(missing from the model, extra in the model, changed "name: old -> new"), each in layout order."""
    missing = [n for n in expected if n not in actual]
    extra = [n for n in actual if n not in expected]
    changed = [f"{n or '(root)'}: {expected[n]} -> {actual[n]}"
               for n in expected if n in actual and expected[n] != actual[n]]
    return missing, extra, changed


def _clip(names: list[str]) -> str:
    shown = ", ".join(repr(n) if n else "(root)" for n in names[:_LIST_LIMIT])
    return shown + (f" and {len(names) - _LIST_LIMIT} more" if len(names) > _LIST_LIMIT else "")


# -- validation helpers --------------------------------------------------------------------------------------

def _path(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _type_names(types: type | tuple[type, ...]) -> str:
    types = types if isinstance(types, tuple) else (types,)
    names = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "dict": "object",
             "list": "array"}
    return " or ".join(names.get(t.__name__, t.__name__) for t in types)


def _check_type(v: Any, path: str, types: type | tuple[type, ...]) -> Any:
    tuple_types = types if isinstance(types, tuple) else (types,)
    if not isinstance(v, tuple_types) or (isinstance(v, bool) and bool not in tuple_types):
        raise PolicyError(f"policy field '{path}' has the wrong type", expected=_type_names(types),
                          found=f"{_json_type(v)} {_short(v)}")
    return v


def _json_type(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", dict: "object", list: "array",
            type(None): "null"}.get(type(v), type(v).__name__)


def _short(v: Any) -> str:
    try:
        text = repr(v)
    except Exception:  # a hostile __repr__ must not turn a PolicyError into another error
        text = f"<{type(v).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def _need(d: Any, key: str, where: str, types: type | tuple[type, ...]) -> Any:
    if not isinstance(d, dict):
        raise PolicyError(f"policy field '{where or '(document)'}' must be an object", found=_json_type(d))
    if key not in d:
        raise PolicyError(f"policy field '{_path(where, key)}' is missing",
                          hint="regenerate the policy with precision-audit, or add the field (docs/policy.md)")
    return _check_type(d[key], _path(where, key), types)


def _optional(d: dict, key: str, where: str, types: type | tuple[type, ...], default: Any) -> Any:
    if key not in d:
        return default
    return _check_type(d[key], _path(where, key), types)


def _format(v: Any, where: str) -> str:
    if not isinstance(v, str) or v not in POLICY_FORMATS:
        raise PolicyError(f"policy field '{where}' has an unknown format", found=_short(v), choices=POLICY_FORMATS)
    return v


def _finite_number(v: Any, path: str) -> float:
    _check_type(v, path, (int, float))
    try:
        x = float(v)
    except OverflowError:  # an integer too large for a float
        raise PolicyError(f"policy field '{path}' is out of range", found=_short(v)) from None
    if not math.isfinite(x):
        raise PolicyError(f"policy field '{path}' must be a finite number", found=_short(v))
    return x


# -- the records ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModuleOverride:
    """One module's format and the reason a person can read."""

    format: str
    reason: str = ""

    def __post_init__(self) -> None:
        _format(self.format, "modules.*.format")
        if not isinstance(self.reason, str):
            raise PolicyError("policy field 'modules.*.reason' must be a string", found=_short(self.reason))

    def to_dict(self) -> dict[str, str]:
        return {"format": self.format, "reason": self.reason}


@dataclass(frozen=True)
class LossScaling:
    """torch.amp.GradScaler settings (its defaults: init 2^16, growth x2 every 2000 clean steps, backoff x0.5)."""

    enabled: bool = False
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        _check_type(self.enabled, "loss_scaling.enabled", bool)
        for name in ("init_scale", "growth_factor", "backoff_factor"):
            _finite_number(getattr(self, name), f"loss_scaling.{name}")
        _check_type(self.growth_interval, "loss_scaling.growth_interval", int)
        if not self.init_scale > 0:
            raise PolicyError("policy field 'loss_scaling.init_scale' must be a positive finite number",
                              found=_short(self.init_scale))
        if not self.growth_factor > 1:
            raise PolicyError("policy field 'loss_scaling.growth_factor' must be > 1", found=_short(self.growth_factor))
        if not 0 < self.backoff_factor < 1:
            raise PolicyError("policy field 'loss_scaling.backoff_factor' must be in (0, 1)",
                              found=_short(self.backoff_factor))
        if self.growth_interval < 1:
            raise PolicyError("policy field 'loss_scaling.growth_interval' must be >= 1",
                              found=_short(self.growth_interval))

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "init_scale": self.init_scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval}


@dataclass(frozen=True)
class Policy:
    """A per-module precision plan for one model on one target GPU (policy.json; docs/policy.md).

    Example::

        import precision_audit as pa
        policy = pa.load_policy("audit/policy.json")
        policy.effective_format("lm_head")            # "fp32"
        handle = pa.apply_policy(model, policy)       # refuses a model it was not made for
        controller = pa.controller(model, optimizer, policy)
        with pa.autocast(policy):
            loss = loss_fn(model(x), y)
        controller.step(loss)
        handle.remove()                               # the model is as before
    """

    model_class: str
    model_fingerprint: str
    model_modules: int
    target_name: str
    target_compute_capability: tuple[int, int] | None
    default_format: str
    modules: dict[str, ModuleOverride] = field(default_factory=dict)
    loss_scaling: LossScaling = field(default_factory=LossScaling)
    tf32_matmul: bool = False
    tf32_cudnn: bool = False
    tool_version: str = ""
    target_key: str | None = None
    #: ``{module name: "Type[param:shape,...]"}`` (see :func:`model_layout`); optional, lets a fingerprint
    #: mismatch name the differing modules.
    model_layout: dict[str, str] | None = None
    #: Top-level keys this version does not know (written by a newer tool); kept and written back unchanged.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_type(self.model_class, "model.class", str)
        _check_type(self.model_fingerprint, "model.fingerprint", str)
        _check_type(self.model_modules, "model.modules", int)
        if self.model_modules < 1:
            raise PolicyError("policy field 'model.modules' must be >= 1 (the model itself counts)",
                              found=_short(self.model_modules))
        _check_type(self.target_name, "target.name", str)
        _format(self.default_format, "default_format")
        _check_type(self.modules, "modules", dict)
        for name, o in self.modules.items():
            _check_type(name, "modules.<name>", str)
            if not isinstance(o, ModuleOverride):
                raise PolicyError(f"policy field 'modules.{name}' must be a ModuleOverride", found=_short(o))
        if not isinstance(self.loss_scaling, LossScaling):
            raise PolicyError("policy field 'loss_scaling' must be a LossScaling", found=_short(self.loss_scaling))
        _check_type(self.tf32_matmul, "tf32.matmul", bool)
        _check_type(self.tf32_cudnn, "tf32.cudnn", bool)
        if self.model_layout is not None:
            _check_layout(self.model_layout, self.model_fingerprint, self.model_modules)

    def __repr__(self) -> str:
        """One line: the model, target, default format, the overrides (the first few named), loss scale, TF32."""
        from .display import policy_repr

        return policy_repr(self)

    def _repr_html_(self) -> str:
        """A notebook cell's view: the same, with every override's format and reason in a table."""
        from .display import policy_html

        return policy_html(self)

    # -- queries -----------------------------------------------------------------------------------------

    def format_for(self, module_name: str) -> str:
        """The module's own override, else the default format (ignores overrides of its parents)."""
        o = self.modules.get(module_name)
        return o.format if o else self.default_format

    def effective_format(self, module_name: str) -> str:
        """The format the module runs in: its override, else its nearest overridden parent's, else the default.

        (A module inherits its parent's format because its forward runs inside the parent's.)
        """
        name = module_name
        while True:
            if name in self.modules:
                return self.modules[name].format
            if not name:
                return self.default_format
            name = name.rpartition(".")[0]

    def with_override(self, module_name: str, format: str, reason: str) -> Policy:
        """A copy with ``module_name`` set to ``format`` (the original is unchanged)."""
        return dataclasses.replace(self, modules={**self.modules, module_name: ModuleOverride(format, reason)})

    # -- the model ---------------------------------------------------------------------------------------

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise :class:`PolicyError` unless ``model`` is the architecture this policy was made for.

        The fingerprint (module names, types, own parameter shapes) must match; with ``model.layout`` in the
        policy the message lists the missing, extra and changed modules. Every override must name a module
        of the model. Wrappers (torch.compile, DDP, DataParallel) are looked through.
        """
        self._check_fingerprint(model)
        self.check_override_names(model)

    def _check_fingerprint(self, model: torch.nn.Module) -> None:
        actual = model_layout(model)
        fp = _layout_fingerprint(actual)
        if fp == self.model_fingerprint:
            return
        root = unwrap_model(model)
        hint = ("apply the policy to the model it was audited with, or re-run precision-audit on this model "
                "(apply_policy(model, policy, strict=False) skips this check)")
        if self.model_layout is None:
            raise PolicyError(
                "this policy was made for another model: the fingerprints differ (the policy has no "
                "model.layout, so the differing modules cannot be named)",
                expected=f"{self.model_class} with {self.model_modules} modules, {self.model_fingerprint}",
                found=f"{type(root).__name__} with {len(actual)} modules, {fp}", hint=hint)
        missing, extra, changed = _layout_diff(self.model_layout, actual)
        parts = []
        if missing:
            parts.append(f"missing from the model ({len(missing)}): {_clip(missing)}")
        if extra:
            parts.append(f"not in the policy ({len(extra)}): {_clip(extra)}")
        if changed:
            parts.append(f"changed type or parameter shapes ({len(changed)}): {'; '.join(changed[:_LIST_LIMIT])}"
                         + (f" and {len(changed) - _LIST_LIMIT} more" if len(changed) > _LIST_LIMIT else ""))
        if not parts:
            parts.append("the same modules in a different order")
        raise PolicyError("this policy was made for another model: " + " | ".join(parts),
                          expected=f"{self.model_class} ({self.model_fingerprint})",
                          found=f"{type(root).__name__} ({fp})", hint=hint)

    def check_override_names(self, model: torch.nn.Module) -> None:
        """Raise :class:`PolicyError` if an override names a module the model does not have."""
        names = [n for n, _ in named_modules(model)]
        known = set(names)
        unknown = [n for n in self.modules if n not in known]
        if unknown:
            close = {n: difflib.get_close_matches(n, names, n=1) for n in unknown}
            hints = [f"{n!r} (did you mean {c[0]!r}?)" if c else repr(n) for n, c in close.items()]
            raise PolicyError(f"policy field 'modules' names module(s) the model does not have: "
                              f"{', '.join(hints[:_LIST_LIMIT])}",
                              expected="names from model.named_modules()",
                              hint="fix the names, or re-run precision-audit on this model")

    # -- the runtime is not here ----------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the record does not have. The runtime used to hang off the record as methods
        # (which made policy/ and runtime/ import each other); a caller of the old spelling is told the new one.
        if name in _MOVED_TO_RUNTIME:
            raise AttributeError(f"Policy.{name}() is no longer a method (the policy record is data only): use "
                                 f"{_MOVED_TO_RUNTIME[name]} (docs/policy.md, \"The runtime\")")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- JSON ------------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        target: dict[str, Any] = {"name": self.target_name,
                                  "compute_capability": list(self.target_compute_capability)
                                  if self.target_compute_capability else None}
        if self.target_key:
            target["key"] = self.target_key
        model: dict[str, Any] = {"class": self.model_class, "fingerprint": self.model_fingerprint,
                                 "modules": self.model_modules}
        if self.model_layout is not None:
            model["layout"] = dict(self.model_layout)
        doc = {
            "schema": POLICY_SCHEMA_ID,
            "version": POLICY_VERSION,
            "tool": {"name": "precision-audit", "version": self.tool_version},
            "model": model,
            "target": target,
            "default_format": self.default_format,
            "modules": {k: v.to_dict() for k, v in self.modules.items()},
            "loss_scaling": self.loss_scaling.to_dict(),
            "tf32": {"matmul": self.tf32_matmul, "cudnn": self.tf32_cudnn},
        }
        doc.update({k: v for k, v in self.extra.items() if k not in doc})
        return doc

    @classmethod
    def from_dict(cls, d: Any) -> Policy:
        """Validate and load; a malformed policy raises :class:`PolicyError` naming the field.

        Never raises anything else for JSON-like input (dicts, lists, strings, numbers, bools, None).
        """
        if not isinstance(d, dict):
            raise PolicyError("a policy must be a JSON object", found=_json_type(d))
        schema = _need(d, "schema", "", str)
        if schema != POLICY_SCHEMA_ID:
            raise PolicyError("policy field 'schema' says this is not a precision-audit policy",
                              expected=repr(POLICY_SCHEMA_ID), found=_short(schema))
        version = _need(d, "version", "", int)
        if version not in SUPPORTED_VERSIONS:
            newer = version > POLICY_VERSION
            raise PolicyError(f"policy field 'version' is {version}, which this precision-audit cannot read",
                              expected=f"one of {', '.join(map(str, SUPPORTED_VERSIONS))}",
                              hint="upgrade precision-audit to read it" if newer else
                              "regenerate the policy with precision-audit")
        tool = _optional(d, "tool", "", dict, {})
        tool_version = _optional(tool, "version", "tool", str, "")

        model = _need(d, "model", "", dict)
        model_class = _need(model, "class", "model", str)
        model_fp = _need(model, "fingerprint", "model", str)
        if not _FINGERPRINT.fullmatch(model_fp):
            raise PolicyError("policy field 'model.fingerprint' is not a fingerprint",
                              expected="'sha256:' and 64 lowercase hex digits", found=_short(model_fp))
        model_modules = _need(model, "modules", "model", int)
        layout = _optional(model, "layout", "model", dict, None)

        target = _need(d, "target", "", dict)
        target_name = _need(target, "name", "target", str)
        cc = target.get("compute_capability")
        if cc is not None and not (isinstance(cc, list) and len(cc) == 2
                                   and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in cc)):
            raise PolicyError("policy field 'target.compute_capability' must be [major, minor] or null",
                              found=_short(cc))
        target_key = _optional(target, "key", "target", str, None)

        default_format = _format(_need(d, "default_format", "", str), "default_format")
        modules_raw = _need(d, "modules", "", dict)
        modules = {}
        for name, o in modules_raw.items():
            if not isinstance(name, str):
                raise PolicyError("policy field 'modules' has a key that is not a string", found=_short(name))
            where = f"modules.{name}"
            fmt = _format(_need(o, "format", where, str), where + ".format")
            reason = _optional(o, "reason", where, str, "")
            modules[name] = ModuleOverride(fmt, reason)

        ls_raw = _need(d, "loss_scaling", "", dict)
        defaults = LossScaling()
        ls = LossScaling(
            enabled=_need(ls_raw, "enabled", "loss_scaling", bool),
            init_scale=_finite_number(_need(ls_raw, "init_scale", "loss_scaling", (int, float)),
                                      "loss_scaling.init_scale"),
            growth_factor=_finite_number(ls_raw.get("growth_factor", defaults.growth_factor),
                                         "loss_scaling.growth_factor"),
            backoff_factor=_finite_number(ls_raw.get("backoff_factor", defaults.backoff_factor),
                                          "loss_scaling.backoff_factor"),
            growth_interval=_optional(ls_raw, "growth_interval", "loss_scaling", int, defaults.growth_interval),
        )
        tf32 = _optional(d, "tf32", "", dict, {"matmul": False, "cudnn": False})
        return cls(
            model_class=model_class,
            model_fingerprint=model_fp,
            model_modules=model_modules,
            target_name=target_name,
            target_compute_capability=(cc[0], cc[1]) if cc else None,
            target_key=target_key,
            default_format=default_format,
            modules=modules,
            loss_scaling=ls,
            tf32_matmul=_need(tf32, "matmul", "tf32", bool),
            tf32_cudnn=_need(tf32, "cudnn", "tf32", bool),
            tool_version=tool_version,
            model_layout=layout,
            extra={k: v for k, v in d.items() if k not in _KNOWN_KEYS},
        )


def _check_layout(layout: Any, fp: str, n_modules: int) -> None:
    _check_type(layout, "model.layout", dict)
    for name, entry in layout.items():
        if not isinstance(name, str) or not isinstance(entry, str) or "[" not in entry or not entry.endswith("]"):
            raise PolicyError("policy field 'model.layout' must map module names to \"Type[param:shape,...]\"",
                              found=f"{_short(name)}: {_short(entry)}")
    if len(layout) != n_modules:
        raise PolicyError(f"policy field 'model.layout' lists {len(layout)} modules but 'model.modules' says "
                          f"{n_modules}", hint="regenerate the policy, or remove model.layout")
    if _layout_fingerprint(layout) != fp:
        raise PolicyError("policy field 'model.layout' does not hash to 'model.fingerprint' (was one of them "
                          "edited?)", hint="regenerate the policy, or remove model.layout")
