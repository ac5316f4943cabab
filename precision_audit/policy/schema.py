"""policy.json: a versioned, validated per-module precision plan (DESIGN §5, §7).

This module imports nothing from the audit machinery, so the training-time runtime can depend on it alone.

Example::

    policy = Policy.from_dict(json.load(open("audit/policy.json")))
    policy.format_for("lm_head")   # "fp32"
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import PolicyError

POLICY_SCHEMA_ID = "precision-audit/policy"
POLICY_VERSION = 1
POLICY_FORMATS = ("fp32", "tf32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2")


def fingerprint(model: torch.nn.Module) -> tuple[str, int]:
    """``("sha256:<hex>", module_count)`` over every module's name, type and own parameter shapes.

    Two models with the same architecture and parameter shapes share a fingerprint whatever their weights.
    """
    h = hashlib.sha256()
    n = 0
    for name, m in model.named_modules():
        params = ",".join(f"{pn}:{'x'.join(map(str, p.shape))}" for pn, p in m.named_parameters(recurse=False))
        h.update(f"{name}\t{type(m).__name__}\t{params}\n".encode())
        n += 1
    return "sha256:" + h.hexdigest(), n


def _need(d: dict, key: str, where: str, types: type | tuple[type, ...]) -> Any:
    if not isinstance(d, dict):
        raise PolicyError(f"policy field '{where}' must be an object", found=type(d).__name__)
    if key not in d:
        raise PolicyError(f"policy field '{where}.{key}' is missing".replace("'.", "'"),
                          hint="regenerate the policy with precision-audit, or add the field")
    v = d[key]
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,))):
        names = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
        raise PolicyError(f"policy field '{(where + '.') if where else ''}{key}' has the wrong type",
                          expected=names, found=f"{type(v).__name__} {v!r}"[:120])
    return v


def _format(v: Any, where: str) -> str:
    if v not in POLICY_FORMATS:
        raise PolicyError(f"policy field '{where}' has an unknown format", found=repr(v), choices=POLICY_FORMATS)
    return v


@dataclass(frozen=True)
class ModuleOverride:
    format: str
    reason: str

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
        if not (self.init_scale > 0 and math.isfinite(self.init_scale)):
            raise PolicyError("policy field 'loss_scaling.init_scale' must be a positive finite number",
                              found=repr(self.init_scale))
        if not self.growth_factor > 1:
            raise PolicyError("policy field 'loss_scaling.growth_factor' must be > 1", found=repr(self.growth_factor))
        if not 0 < self.backoff_factor < 1:
            raise PolicyError("policy field 'loss_scaling.backoff_factor' must be in (0, 1)",
                              found=repr(self.backoff_factor))
        if self.growth_interval < 1:
            raise PolicyError("policy field 'loss_scaling.growth_interval' must be >= 1", found=repr(self.growth_interval))

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "init_scale": self.init_scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval}


@dataclass(frozen=True)
class Policy:
    """A per-module precision plan for one model on one target GPU."""

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

    def __post_init__(self) -> None:
        _format(self.default_format, "default_format")
        for name, o in self.modules.items():
            _format(o.format, f"modules.{name}.format")

    def format_for(self, module_name: str) -> str:
        o = self.modules.get(module_name)
        return o.format if o else self.default_format

    def to_dict(self) -> dict[str, Any]:
        target: dict[str, Any] = {"name": self.target_name,
                                  "compute_capability": list(self.target_compute_capability)
                                  if self.target_compute_capability else None}
        if self.target_key:
            target["key"] = self.target_key
        return {
            "schema": POLICY_SCHEMA_ID,
            "version": POLICY_VERSION,
            "tool": {"name": "precision-audit", "version": self.tool_version},
            "model": {"class": self.model_class, "fingerprint": self.model_fingerprint, "modules": self.model_modules},
            "target": target,
            "default_format": self.default_format,
            "modules": {k: v.to_dict() for k, v in self.modules.items()},
            "loss_scaling": self.loss_scaling.to_dict(),
            "tf32": {"matmul": self.tf32_matmul, "cudnn": self.tf32_cudnn},
        }

    @classmethod
    def from_dict(cls, d: Any) -> "Policy":
        """Validate and load; a malformed policy raises :class:`PolicyError` naming the field."""
        if not isinstance(d, dict):
            raise PolicyError("a policy must be a JSON object", found=type(d).__name__)
        schema = _need(d, "schema", "", str)
        if schema != POLICY_SCHEMA_ID:
            raise PolicyError("this is not a precision-audit policy", expected=f"schema '{POLICY_SCHEMA_ID}'",
                              found=repr(schema))
        version = _need(d, "version", "", int)
        if version > POLICY_VERSION or version < 1:
            raise PolicyError(f"policy version {version} is not supported by this precision-audit",
                              expected=f"version 1..{POLICY_VERSION}", hint="upgrade precision-audit to read it")
        tool = d.get("tool") or {}
        model = _need(d, "model", "", dict)
        target = _need(d, "target", "", dict)
        cc = target.get("compute_capability")
        if cc is not None and not (isinstance(cc, list) and len(cc) == 2 and all(isinstance(x, int) for x in cc)):
            raise PolicyError("policy field 'target.compute_capability' must be [major, minor]", found=repr(cc))
        modules_raw = _need(d, "modules", "", dict)
        modules = {}
        for name, o in modules_raw.items():
            where = f"modules.{name}"
            fmt = _need(o, "format", where, str)
            reason = o.get("reason", "") if isinstance(o, dict) else ""
            if not isinstance(reason, str):
                raise PolicyError(f"policy field '{where}.reason' must be a string", found=repr(reason))
            modules[name] = ModuleOverride(_format(fmt, where + ".format"), reason)
        ls_raw = _need(d, "loss_scaling", "", dict)
        ls = LossScaling(
            enabled=_need(ls_raw, "enabled", "loss_scaling", bool),
            init_scale=float(_need(ls_raw, "init_scale", "loss_scaling", (int, float))),
            growth_factor=float(ls_raw.get("growth_factor", 2.0)),
            backoff_factor=float(ls_raw.get("backoff_factor", 0.5)),
            growth_interval=int(ls_raw.get("growth_interval", 2000)),
        )
        tf32 = d.get("tf32", {"matmul": False, "cudnn": False})
        return cls(
            model_class=_need(model, "class", "model", str),
            model_fingerprint=_need(model, "fingerprint", "model", str),
            model_modules=_need(model, "modules", "model", int),
            target_name=_need(target, "name", "target", str),
            target_compute_capability=tuple(cc) if cc else None,
            target_key=target.get("key"),
            default_format=_format(_need(d, "default_format", "", str), "default_format"),
            modules=modules,
            loss_scaling=ls,
            tf32_matmul=bool(_need(tf32, "matmul", "tf32", bool)),
            tf32_cudnn=bool(_need(tf32, "cudnn", "tf32", bool)),
            tool_version=str(tool.get("version", "")) if isinstance(tool, dict) else "",
        )
