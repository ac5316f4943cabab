"""The training-step controller: loss scaling, the non-finite check, the stability monitor, adaptive fallback.

``controller.step(loss)`` does, in this order, what a hand-written ``torch.amp`` loop does, plus checks::

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    total gradient norm; under torch.distributed: all-reduce (MAX) of the GradScaler's found_inf
    [clip to max_grad_norm]
    one device sync (loss, norm, found_inf, scale)
    per-module non-finite check (only on a step whose gradients are not all finite)
    scaler.step(optimizer); scaler.update(); optimizer.zero_grad(set_to_none=True)
    monitor.observe(...)

Without faults the GradScaler's state is step for step the one of the plain loop (tests/test_runtime.py).

**Distributed.** A rank's GradScaler only sees its own gradients. DDP averages gradients during backward, so
an inf on one rank usually reaches all, but not always (``no_sync`` accumulation, parameters outside DDP,
hand-written gradient sync). Under an initialised process group with more than one rank the controller
all-reduces (MAX) the found_inf flags before ``scaler.step``, so every rank skips the same steps and their
scales stay equal; in adaptive mode it all-reduces the per-module findings too, so every rank promotes the
same modules.

**Adaptive mode** (``adaptive=True``). Forward hooks on every module record, per call, whether the floating
inputs were finite and the outputs not, and tensor hooks on the outputs whether the incoming gradient was
finite. On a step with non-finite gradients the controller finds where they started:

- *forward source*: the innermost module whose output was non-finite although its inputs were finite (an
  activation overflow, e.g. fp16's 65504). Loss scaling cannot fix this.
- *backward source*: the innermost module whose gradient arriving at its output was finite but whose
  parameters' gradients were not, counted only when the loss scale is already <= 1 (or scaling is off): above
  that, an overflow in backward is the GradScaler's to fix by backing off, and it will.

A module that is a source for ``promote_after`` consecutive steps (default 3) while running in fp16 or bf16
is promoted to fp32 in the controller's copy of the policy (``controller.policy``), the applied handle is
updated in place, the change is logged (WARNING), and ``controller.save_policy(path)`` writes the updated
policy. A source already in fp32 is reported once and left alone (it is not a precision problem).

Works on a model wrapped by torch.compile (names and hooks are the inner model's; create the controller
before the first compiled forward, since hooks added to already-compiled code are not traced) and by DDP.
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from typing import Any

import torch

from ..errors import OptionError
from ..policy import Policy, named_modules, save_policy, unwrap_model
from .apply import LOW_PRECISION_DTYPES, _ACTIVE, apply_policy
from .monitor import StabilityMonitor, StepRecord

log = logging.getLogger(__name__)

#: A gradient overflow in backward counts towards promotion only once the loss scale is this low: above it,
#: the GradScaler backs off and the overflow goes away by itself.
BACKWARD_SOURCE_MAX_SCALE = 1.0


def _floating_tensors(x: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        if x.is_floating_point():
            out.append(x)
    elif isinstance(x, (tuple, list)):
        for v in x:
            _floating_tensors(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _floating_tensors(v, out)
    return out


def _range(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(min, max) of ``t`` in one kernel; both are non-finite iff some element is (aminmax propagates NaN)."""
    if t.numel() == 0:
        return None
    with torch.no_grad():
        return torch.aminmax(t.detach())


def _innermost(names: set[str]) -> list[str]:
    """Drop every name that is a parent of another name in the set (the root "" is everyone's parent)."""
    keep = []
    for n in names:
        if not any(m != n and (n == "" or m.startswith(n + ".")) for m in names):
            keep.append(n)
    return sorted(keep)


class _SourceProbe:
    """Forward hooks recording, per module call, the (min, max) of its floating inputs and outputs, and tensor
    hooks recording those of the gradient arriving at its outputs.

    The values stay tensors (no device sync) until :meth:`evaluate` runs on a step that found non-finite
    gradients; a tensor seen twice in a step (one module's output is the next one's input) is reduced once.
    """

    def __init__(self, modules: list[tuple[str, torch.nn.Module]]) -> None:
        self.names = [n for n, _ in modules]
        self.fwd: list[tuple[int, list, list]] = []  # (module index, input ranges, output ranges)
        self.bwd: list[tuple[int, tuple]] = []  # (module index, output-gradient range)
        self._memo: dict[int, tuple[weakref.ref, int, Any]] = {}
        self.handles = [m.register_forward_hook(self._make_hook(i), with_kwargs=True)
                        for i, (_, m) in enumerate(modules)]

    def _range_of(self, t: torch.Tensor) -> Any:
        hit = self._memo.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit[2]
        r = _range(t)
        self._memo[id(t)] = (weakref.ref(t), t._version, r)
        return r

    def _make_hook(self, i: int):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            outs = _floating_tensors(output, [])
            if not outs:
                return
            ins = _floating_tensors((args, kwargs), [])
            self.fwd.append((i, [r for t in ins if (r := self._range_of(t)) is not None],
                             [r for t in outs if (r := self._range_of(t)) is not None]))
            for t in outs:
                if t.requires_grad:
                    t.register_hook(grad_hook)

        def grad_hook(grad: torch.Tensor) -> None:
            r = _range(grad)
            if r is not None:
                self.bwd.append((i, r))

        return hook

    def clear(self) -> None:
        self.fwd.clear()
        self.bwd.clear()
        self._memo.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.clear()

    def evaluate(self, nonfinite_params: set[str], backward_counts: bool, device: torch.device,
                 reduce: Any) -> tuple[list[str], list[str]]:
        """(forward sources, backward sources), innermost only; ``reduce`` all-reduces a flag tensor (MAX)."""
        flat: list[torch.Tensor] = []

        def add(ranges: list) -> tuple[int, int]:
            start = len(flat)
            for lo, hi in ranges:
                flat.append(lo.float().to(device))
                flat.append(hi.float().to(device))
            return start, len(flat)

        spans = [(i, add(ins), add(outs)) for i, ins, outs in self.fwd]
        gspans = [(i, add([r])) for i, r in self.bwd]
        finite = torch.isfinite(torch.stack(flat)).tolist() if flat else []
        bad = lambda span: not all(finite[span[0]:span[1]])  # noqa: E731
        n = len(self.names)
        fwd_src = [0.0] * n
        for i, ins, outs in spans:
            if bad(outs) and not bad(ins):
                fwd_src[i] = 1.0
        grad_seen = [False] * n
        grad_bad = [False] * n
        for i, span in gspans:
            grad_seen[i] = True
            grad_bad[i] = grad_bad[i] or bad(span)
        bwd_src = [0.0] * n
        if backward_counts:
            for i, name in enumerate(self.names):
                if grad_seen[i] and not grad_bad[i] and any(
                        name == "" or p == name or p.startswith(name + ".") for p in nonfinite_params):
                    bwd_src[i] = 1.0
        agreed = reduce(torch.tensor(fwd_src + bwd_src, device=device)).tolist()
        fwd = {self.names[i] for i in range(n) if agreed[i]}
        bwd = {self.names[i] for i in range(n) if agreed[n + i]}
        return _innermost(fwd), _innermost(bwd)


class PrecisionController:
    """Runs each training step of a model trained under a policy: see the module docstring.

    Example::

        policy = load_policy("audit/policy.json")
        handle = policy.apply(model)
        controller = policy.controller(model, optimizer, adaptive=True)
        for x, y in loader:
            with policy.autocast("cuda"):
                loss = loss_fn(model(x), y)
            controller.step(loss)
        print(controller.monitor.summary())
        controller.save_policy("audit/policy.updated.json")   # with any promotions

    Arguments beyond ``policy, model, optimizer`` (keyword only): ``adaptive`` (promote modules that keep
    producing non-finite values to fp32), ``promote_after`` (consecutive steps, default 3), ``device``
    (the GradScaler's device type; default: the parameters'), ``max_grad_norm`` (clip the unscaled gradients
    to this total norm), ``process_group`` (for the distributed agreement; default: the default group),
    ``strict`` (refuse a model whose fingerprint differs; default True), ``monitor`` (a
    :class:`StabilityMonitor` to use) or ``spike_window`` / ``spike_factor`` (to configure a new one).
    """

    def __init__(self, policy: Policy, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 adaptive: bool = False, promote_after: int = 3, device: str | torch.device | None = None,
                 max_grad_norm: float | None = None, process_group: Any = None, strict: bool = True,
                 monitor: StabilityMonitor | None = None, spike_window: int = 50,
                 spike_factor: float = 3.0) -> None:
        if not isinstance(policy, Policy):
            raise OptionError("the controller needs a Policy", found=type(policy).__name__)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise OptionError("the controller needs a torch.optim.Optimizer", found=type(optimizer).__name__)
        if not (isinstance(promote_after, int) and promote_after >= 1):
            raise OptionError("promote_after must be an integer >= 1", found=repr(promote_after))
        if max_grad_norm is not None and not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise OptionError("max_grad_norm must be a positive finite number or None", found=repr(max_grad_norm))
        if strict:
            policy.check_model(model)
        else:
            policy.check_override_names(model)
        self.model = model
        self.root = unwrap_model(model)
        self.optimizer = optimizer
        self._policy = policy
        self.adaptive = adaptive
        self.promote_after = promote_after
        self.max_grad_norm = max_grad_norm
        self.process_group = process_group
        self.monitor = monitor if monitor is not None else StabilityMonitor(spike_window=spike_window,
                                                                            spike_factor=spike_factor)
        modules = list(named_modules(self.root))
        seen: set[int] = set()
        self._params: list[torch.nn.Parameter] = []
        self._module_params: list[tuple[str, list[torch.nn.Parameter]]] = []
        for name, m in modules:
            own = [p for p in m.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in own)
            self._params.extend(own)
            if own:
                self._module_params.append((name, own))
        if device is None:
            device = self._params[0].device.type if self._params else "cpu"
        self.device_type = torch.device(device).type if not isinstance(device, str) else device.split(":")[0]
        self.scaler = policy.grad_scaler(self.device_type)
        self._step = 0
        self._streaks: dict[str, int] = {}
        self._reported_fp32_sources: set[str] = set()
        self._own_handle = None
        self._probe = _SourceProbe(modules) if adaptive else None
        if adaptive and type(model).__name__ == "OptimizedModule":
            log.info("adaptive controller on a torch.compile'd model: its hooks are traced only by code compiled "
                     "after this point")

    # -- public ------------------------------------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        """The policy in effect, with any adaptive promotions (the one passed in is never modified)."""
        return self._policy

    @property
    def steps(self) -> int:
        return self._step

    def save_policy(self, path: str | os.PathLike[str]) -> None:
        """Write :attr:`policy` (with any promotions) to ``path`` atomically."""
        save_policy(self._policy, path)

    def close(self) -> None:
        """Remove the adaptive hooks (and a handle the controller applied itself). The scaler stays usable."""
        if self._probe is not None:
            self._probe.remove()
            self._probe = None
        if self._own_handle is not None:
            self._own_handle.remove()
            self._own_handle = None

    def step(self, loss: torch.Tensor) -> StepRecord:
        """Backward, unscale, non-finite check, optimizer step, scaler update, zero_grad; returns the record."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise OptionError("controller.step(loss) takes the loss as a one-element tensor",
                              found=type(loss).__name__ if not isinstance(loss, torch.Tensor) else
                              f"a tensor of shape {tuple(loss.shape)}")
        self._step += 1
        scaler, opt = self.scaler, self.optimizer
        try:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            dev = loss.device
            grads = [p.grad for p in self._params if p.grad is not None]
            norm = (torch.nn.utils.get_total_norm(grads).to(dev) if grads else torch.zeros((), device=dev)).float()
            found_infs = self._found_infs()
            if not found_infs:
                found = torch.zeros((), device=dev)
            elif len(found_infs) == 1:
                found = found_infs[0].to(dev).reshape(()).float()
            else:
                found = torch.stack([v.to(dev).reshape(()) for v in found_infs]).sum().float()
            flags = torch.stack([found, (~torch.isfinite(norm)).float()])
            if self._distributed():
                import torch.distributed as dist

                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
                for v in found_infs:  # every rank now skips (and backs off) together
                    v.copy_(flags[0].to(v.device).reshape(v.shape))
            if self.max_grad_norm is not None:
                torch.nn.utils.clip_grads_with_norm_(self._params, self.max_grad_norm, norm)
            scale_t = self._scale_tensor(dev)
            # one device sync for everything the monitor needs
            loss_v, norm_v, found_v, bad_norm, scale_v = torch.cat(
                [loss.detach().float().reshape(1), norm.reshape(1), flags, scale_t]).tolist()
            scale_used = scale_v if scaler.is_enabled() else None
            bad = found_v > 0 or bad_norm > 0
            nonfinite = self._scan_modules() if bad else ()
            fwd_src: list[str] = []
            bwd_src: list[str] = []
            if bad and self._probe is not None:
                backward_counts = scale_used is None or scale_used <= BACKWARD_SOURCE_MAX_SCALE
                fwd_src, bwd_src = self._probe.evaluate(set(nonfinite), backward_counts, dev, self._reduce_max)
            scaler.step(opt)
            scaler.update()
        finally:
            if self._probe is not None:
                self._probe.clear()
        opt.zero_grad(set_to_none=True)
        skipped = scaler.is_enabled() and found_v > 0
        promoted = self._adapt(fwd_src, bwd_src) if self.adaptive else ()
        return self.monitor.observe(step=self._step, loss=loss_v, scale=scale_used, skipped=skipped,
                                    grad_norm=norm_v, nonfinite_modules=nonfinite,
                                    sources=tuple(fwd_src) + tuple(n for n in bwd_src if n not in fwd_src),
                                    promoted=promoted)

    # -- internals ---------------------------------------------------------------------------------------

    def _scale_tensor(self, device: torch.device) -> torch.Tensor:
        """The scale used this step as a 1-element tensor (read without a device sync where possible)."""
        scale = getattr(self.scaler, "_scale", None) if self.scaler.is_enabled() else None
        if isinstance(scale, torch.Tensor):
            return scale.detach().to(device, torch.float32).reshape(1)
        return torch.tensor([self.scaler.get_scale() if self.scaler.is_enabled() else 0.0], device=device)

    def _found_infs(self) -> list[torch.Tensor]:
        if not self.scaler.is_enabled():
            return []
        # GradScaler keeps the per-device found_inf tensors of an unscaled optimizer here (torch's own
        # ShardedGradScaler reads and all-reduces the same ones).
        states = getattr(self.scaler, "_per_optimizer_states", None)
        if states is None or "found_inf_per_device" not in states.get(id(self.optimizer), {}):
            raise RuntimeError("this torch's GradScaler keeps no found_inf_per_device state; the controller "
                               "needs torch.amp.GradScaler as of torch 2.4-2.13")
        return list(states[id(self.optimizer)]["found_inf_per_device"].values())

    def _distributed(self) -> bool:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1

    def _reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        if self._distributed():
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        return t

    def _scan_modules(self) -> tuple[str, ...]:
        checks = []
        for name, params in self._module_params:
            gs = [p.grad for p in params if p.grad is not None]
            if gs:
                checks.append((name, torch.stack([(~torch.isfinite(g).all()).to(gs[0].device) for g in gs]).any()))
        if not checks:
            return ()
        dev = checks[0][1].device
        vals = torch.stack([c.to(dev) for _, c in checks]).tolist()
        return tuple(name for (name, _), v in zip(checks, vals) if v)

    def _adapt(self, fwd_src: list[str], bwd_src: list[str]) -> tuple[str, ...]:
        kinds = {n: "its output overflowed from finite inputs" for n in fwd_src}
        kinds.update({n: "its gradients overflowed at loss scale <= 1" for n in bwd_src if n not in kinds})
        streaks = {n: self._streaks.get(n, 0) + 1 for n in kinds}
        self._streaks = streaks
        promoted = []
        policy = self._policy
        for name in sorted(streaks):
            fmt = policy.effective_format(name)
            if fmt not in LOW_PRECISION_DTYPES:
                if name not in self._reported_fp32_sources:
                    self._reported_fp32_sources.add(name)
                    log.warning("adaptive precision: non-finite values start in %r, which already runs in %s: "
                                "not a precision problem, nothing to promote", name or "(root)", fmt)
                continue
            if streaks[name] < self.promote_after:
                continue
            reason = (f"promoted from {fmt} to fp32 by the adaptive controller at step {self._step}: {kinds[name]} "
                      f"in {streaks[name]} consecutive steps")
            policy = policy.with_override(name, "fp32", reason)
            promoted.append(name)
            del self._streaks[name]
            log.warning("adaptive precision: %r %s", name or "(root)", reason)
        if promoted:
            self._set_policy(policy)
        return tuple(promoted)

    def _set_policy(self, policy: Policy) -> None:
        self._policy = policy
        handle = _ACTIVE.get(self.root)
        if handle is not None:
            handle._reapply(policy)
        else:
            self._own_handle = apply_policy(policy, self.model, strict=False)
            log.info("adaptive precision: the policy was not applied to the model; the controller applied its "
                     "updated copy (controller.close() removes it)")
