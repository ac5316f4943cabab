"""Applying a policy in training (docs/policy.md, "The runtime"). Imports only :mod:`precision_audit.policy`,
:mod:`precision_audit.errors` and torch — never the audit machinery (docs/architecture.md).

Example::

    import precision_audit as pa
    policy = pa.load_policy("audit/policy.json")
    handle = pa.apply_policy(model, policy)              # per-module formats; .remove() undoes it
    controller = pa.controller(model, optimizer, policy) # GradScaler + stability monitor (+ adaptive=True)
    with pa.autocast(policy, "cuda"):
        loss = loss_fn(model(x), y)
    controller.step(loss)

The four functions live in :mod:`precision_audit.runtime.api`. ``controller`` is not re-exported here: this
package's submodule :mod:`precision_audit.runtime.controller` holds that name.
"""

from .api import apply_policy, autocast, grad_scaler
from .apply import PolicyAutocast, PolicyHandle, active_handle, make_grad_scaler
from .controller import BACKWARD_SOURCE_MAX_SCALE, PrecisionController
from .monitor import StabilityMonitor, StepRecord

__all__ = [
    "BACKWARD_SOURCE_MAX_SCALE", "PolicyAutocast", "PolicyHandle", "PrecisionController", "StabilityMonitor",
    "StepRecord", "active_handle", "apply_policy", "autocast", "grad_scaler", "make_grad_scaler",
]
