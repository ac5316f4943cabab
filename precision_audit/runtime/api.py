"""The runtime's public functions: a policy record (data) in, the model trained under it.

These are what ``import precision_audit as pa`` offers (docs/policy.md, "The runtime"); the policy record
(:class:`~precision_audit.policy.Policy`) has no runtime methods, so that the record never imports the runtime
(docs/architecture.md)::

    policy = pa.load_policy("audit/policy.json")        # a validated record: data only
    handle = pa.apply_policy(model, policy)              # per-module formats; handle.remove() undoes it
    controller = pa.controller(model, optimizer, policy) # GradScaler + stability monitor (+ adaptive=True)
    with pa.autocast(policy, "cuda"):                    # the default format for the forward pass
        loss = loss_fn(model(x), y)
    controller.step(loss)
"""

from __future__ import annotations

from typing import Any

import torch

from ..policy import Policy
from .apply import PolicyAutocast, apply_policy, make_grad_scaler
from .controller import PrecisionController
from .fsdp import shard_fsdp2
from .monitor import StabilityMonitor

__all__ = ["apply_policy", "autocast", "controller", "grad_scaler", "shard_fsdp2"]


def autocast(policy: Policy, device_type: str = "cuda", *, enabled: bool = True) -> PolicyAutocast:
    """The context for the forward pass: autocast in the policy's default format (disabled for fp32/tf32),
    with the policy's TF32 switches set inside and the user's restored after, even on error.

    Example::

        with pa.autocast(policy, "cuda"):
            loss = loss_fn(model(x), y)
    """
    return PolicyAutocast(policy, device_type, enabled=enabled)


def grad_scaler(policy: Policy, device: str = "cuda") -> torch.amp.GradScaler:
    """A ``torch.amp.GradScaler`` configured from ``policy.loss_scaling`` (disabled when it is not enabled)."""
    return make_grad_scaler(policy, device)


def controller(model: torch.nn.Module, optimizer: torch.optim.Optimizer, policy: Policy, *,
               adaptive: bool = False, promote_after: int = 3, device: str | torch.device | None = None,
               max_grad_norm: float | None = None, process_group: Any = None, strict: bool = True,
               monitor: StabilityMonitor | None = None, spike_window: int = 50, spike_factor: float = 3.0,
               attribute: bool = True, watch: bool = False, watch_every: int = 10, horizon: int = 200,
               min_confidence: float = 0.9, watch_writer: Any = None) -> PrecisionController:
    """A :class:`~precision_audit.runtime.PrecisionController` whose ``step(loss)`` does the scaled backward,
    unscale, non-finite check (skipping any step with a non-finite gradient), optimizer step and scaler
    update, and feeds the stability monitor.

    ``adaptive=True`` promotes a module to fp32 when it starts non-finite values for ``promote_after``
    consecutive steps. ``watch=True`` records per-module amax every ``watch_every`` steps, forecasts when a
    format's limit would be crossed and promotes the module (or lowers the loss scale) ``horizon`` steps ahead
    (docs/policy.md, "Watch and forecast"). The other arguments are
    :class:`~precision_audit.runtime.PrecisionController`'s.
    Example::

        ctl = pa.controller(model, optimizer, policy, adaptive=True)
        with pa.autocast(policy, "cuda"):
            loss = loss_fn(model(x), y)
        ctl.step(loss)
    """
    return PrecisionController(policy, model, optimizer, adaptive=adaptive, promote_after=promote_after,
                               device=device, max_grad_norm=max_grad_norm, process_group=process_group,
                               strict=strict, monitor=monitor, spike_window=spike_window,
                               spike_factor=spike_factor, attribute=attribute, watch=watch,
                               watch_every=watch_every, horizon=horizon, min_confidence=min_confidence,
                               watch_writer=watch_writer)
