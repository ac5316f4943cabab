"""Applying a policy in training (DESIGN §7 Runtime API). Imports only :mod:`precision_audit.policy`,
:mod:`precision_audit.errors` and torch — never the audit machinery.

Example::

    from precision_audit import load_policy
    policy = load_policy("audit/policy.json")
    handle = policy.apply(model)                          # per-module formats; .remove() undoes it
    controller = policy.controller(model, optimizer)      # GradScaler + stability monitor (+ adaptive=True)
    with policy.autocast("cuda"):
        loss = loss_fn(model(x), y)
    controller.step(loss)
"""

from .apply import PolicyAutocast, PolicyHandle, active_handle, apply_policy, make_grad_scaler
from .controller import BACKWARD_SOURCE_MAX_SCALE, PrecisionController
from .monitor import StabilityMonitor, StepRecord

__all__ = [
    "BACKWARD_SOURCE_MAX_SCALE", "PolicyAutocast", "PolicyHandle", "PrecisionController", "StabilityMonitor",
    "StepRecord", "active_handle", "apply_policy", "make_grad_scaler",
]
