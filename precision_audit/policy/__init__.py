"""The precision policy format (policy.json, schema ``precision-audit/policy`` version 1)."""

from .schema import POLICY_SCHEMA_ID, POLICY_VERSION, LossScaling, ModuleOverride, Policy, fingerprint

__all__ = ["POLICY_SCHEMA_ID", "POLICY_VERSION", "LossScaling", "ModuleOverride", "Policy", "fingerprint"]
