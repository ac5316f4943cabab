"""Export a policy to the settings another training stack reads: every target in one table (docs/policy.md,
"Exporting to other stacks"; docs/fp8.md for the FP8 targets).

The mixed-precision targets (DeepSpeed, Lightning, Accelerate, FSDP) are :mod:`precision_audit.policy.exporters`'s;
the FP8 targets (torchao, torchtitan) are :mod:`precision_audit.fp8.export`'s. This module sits above both, so
``policy/`` never imports ``fp8/`` (which imports the capture): the package graph stays acyclic
(docs/architecture.md).

Example::

    from precision_audit.export import export_policy
    from precision_audit.policy import load_policy
    out = export_policy(load_policy("audit/policy.json"), "deepspeed")
    print(out.text); print(out.notes)
"""

from __future__ import annotations

from .errors import OptionError
from .policy.exported import Export
from .policy.exporters import EXPORTERS
from .policy.schema import Policy

#: Every target of ``precision-audit export --to``.
EXPORT_TARGETS = (*EXPORTERS, "torchao", "torchtitan")


def export_policy(policy: Policy, to: str, *, policy_path: str = "policy.json") -> Export:
    """The nearest equivalent of ``policy`` for training stack ``to`` (one of :data:`EXPORT_TARGETS`).

    ``policy_path`` is the path the generated Python loads the policy from (for the per-module part).
    """
    if to in EXPORTERS:
        return EXPORTERS[to](policy, policy_path)
    if to in ("torchao", "torchtitan"):
        from .fp8 import export as fp8_export  # the policy's fp8 modules (issue 16, docs/fp8.md)

        return getattr(fp8_export, f"export_{to}")(policy, policy_path)
    raise OptionError(f"cannot export a policy to {to!r}", choices=EXPORT_TARGETS)
