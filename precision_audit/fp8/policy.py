"""The FP8 part of policy.json: which modules train under which recipe (docs/fp8.md, "policy.json").

It is one additive top-level key, so a version-1 policy without it still loads and a reader that does not know it
keeps it (policy/schema.py keeps unknown top-level keys in ``Policy.extra`` and writes them back)::

    "fp8": {"modules": {"blocks.0.mlp.fc1": {"recipe": "fp8_rowwise", "reason": "..."}}}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import PolicyError
from .recipes import RECIPES

KEY = "fp8"


@dataclass(frozen=True)
class Fp8Module:
    recipe: str
    reason: str = ""


@dataclass(frozen=True)
class Fp8Plan:
    modules: dict[str, Fp8Module] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"modules": {n: {"recipe": m.recipe, "reason": m.reason} for n, m in sorted(self.modules.items())}}

    @classmethod
    def from_dict(cls, d: Any) -> Fp8Plan:
        """Validate the ``fp8`` section; a malformed one raises :class:`PolicyError` naming the field."""
        if not isinstance(d, dict):
            raise PolicyError("policy field 'fp8' must be an object", found=type(d).__name__)
        mods = d.get("modules", {})
        if not isinstance(mods, dict):
            raise PolicyError("policy field 'fp8.modules' must be an object", found=type(mods).__name__)
        out = {}
        for name, o in mods.items():
            where = f"fp8.modules.{name!r}"
            if not isinstance(o, dict):
                raise PolicyError(f"policy field {where} must be an object", found=type(o).__name__)
            recipe = o.get("recipe")
            if not isinstance(recipe, str) or recipe not in RECIPES:  # a list or an object is not hashable
                raise PolicyError(f"policy field {where}.recipe is not a known FP8 recipe", found=repr(recipe),
                                  choices=list(RECIPES))
            reason = o.get("reason", "")
            if not isinstance(reason, str):
                raise PolicyError(f"policy field {where}.reason must be a string", found=type(reason).__name__)
            out[name] = Fp8Module(recipe, reason)
        return cls(out)

    @classmethod
    def from_policy(cls, policy: Any) -> Fp8Plan:
        """The FP8 plan of a loaded :class:`~precision_audit.policy.schema.Policy` (empty when it has none)."""
        extra = getattr(policy, "extra", None) or {}
        return cls.from_dict(extra[KEY]) if KEY in extra else cls()
