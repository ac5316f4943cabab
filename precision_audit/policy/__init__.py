"""The precision policy format (policy.json, schema ``precision-audit/policy`` version 1; docs/policy.md).

Imports nothing from the audit machinery: a training script that loads a policy pulls in torch and this.
The model-naming helpers it re-exports (``named_modules``, ``unwrap_model``, ``fingerprint``, ``model_layout``) live
in precision_audit/model_names.py.
"""

from ..model_names import fingerprint, model_layout, named_modules, unwrap_model
from .io import dumps_policy, load_policy, parse_policy, save_policy
from .schema import (
    POLICY_FORMATS,
    POLICY_SCHEMA_ID,
    POLICY_VERSION,
    RUNTIME_FORMATS,
    SUPPORTED_VERSIONS,
    LossScaling,
    ModuleOverride,
    Policy,
)

__all__ = [
    "POLICY_FORMATS", "POLICY_SCHEMA_ID", "POLICY_VERSION", "RUNTIME_FORMATS", "SUPPORTED_VERSIONS",
    "LossScaling", "ModuleOverride", "Policy", "dumps_policy", "fingerprint", "load_policy", "model_layout",
    "named_modules", "parse_policy", "save_policy", "unwrap_model",
]
