"""The training-step controller: loss scaling, the non-finite check, the stability monitor, adaptive fallback.

``controller.step(loss)`` does, in this order, what a hand-written ``torch.amp`` loop does, plus checks::

    scaler.scale(loss).backward()          -- under the policy's TF32 switches (runtime/backward_tf32.py)
    scaler.unscale_(optimizer)
    total gradient norm; under torch.distributed: all-reduce (MAX) of found_inf and "norm not finite"
    one device sync (loss, norm, found_inf, scale: runtime/readout.py) -- the step's only one when it is clean
    only if found_inf or the norm is not finite: per-module non-finite scan (decides the skip, agreed across
    ranks) and the source attribution (a replay of the forward, or per-call records)
    [clip to max_grad_norm, on a step that updates: after the check, so a NaN norm cannot poison the scan]
    optimizer.step() -- skipped whenever a gradient is non-finite, in every format (as scaler.step would, on
    the flags already read); scaler.update()
    optimizer.zero_grad(set_to_none=True); monitor.observe(...)

Without faults the GradScaler's state is step for step the one of the plain loop (tests/runtime/test_runtime.py).

**No non-finite update, in any format** (docs/policy.md, "The runtime"). With a GradScaler, a non-finite gradient
makes the step skip as ``scaler.step`` would and ``scaler.update`` back off (the controller sets found_inf
itself for gradients the GradScaler does not see: optimizer parameters it was not given). Without one (bf16,
fp32, fp16 with loss scaling off) the controller does not call ``optimizer.step()``. The non-finite total norm
is only the gate: a norm that overflows from finite gradients does not skip. Skipped steps are counted
(``controller.skipped_steps``) and logged at WARNING, with their source; a GradScaler backoff from an overflow
in the scaled backward (finite forward, scale > 1) is routine and logged at INFO.

**Distributed.** A rank's GradScaler only sees its own gradients. DDP averages gradients during backward, so
an inf on one rank usually reaches all, but not always (``no_sync`` accumulation, parameters outside DDP,
hand-written gradient sync). Under an initialised process group with more than one rank the controller
all-reduces (MAX) the flags before ``scaler.step``, so every rank skips the same steps and their scales stay
equal; it all-reduces the findings too (the non-finite modules, the source), and takes the source's description
from the lowest rank that saw it, so every rank names and promotes the same module with the same reason and saves
the same policy. Under FSDP2 a rank's gradients are DTensor shards: the scan reads each rank's shard, the norm is
the global one (docs/distributed.md, "The runtime across ranks").

**Source attribution** (every mode). On a step with non-finite gradients the *source* is the first module, in
the order the calls finished, whose output was non-finite although its inputs were finite (an activation
overflow, e.g. fp16's 65504, or a real fault). Loss scaling cannot fix it. It is found from per-call records of
the (min, max) of every module's floating inputs and outputs, taken in one of two ways:

- *replay* (the default): a clean step pays for nothing but one forward pre-hook and one forward hook on the
  root module, which keep the root call's arguments (references), the state its forward starts from (each
  module's attribute dictionary, shallowly; the RNG states; the autocast and grad modes) and the (min, max) of
  the root's outputs. Only on a bad step, before the optimizer step, is that forward run again from that state
  with the per-module records armed, and the model put back as the first run left it (attributes, buffers,
  RNG). The replay must reproduce the root's outputs exactly (the same (min, max)) and find the arguments
  unmodified; otherwise no source is named and the log says why. A training step's cost on clean steps is
  thus that of the plain torch.amp loop (bench/runtime_overhead.py).
- *per call* (adaptive mode, whose backward-source rule needs the real backward's gradients, and a model
  wrapped by torch.compile, where the records are part of the compiled graph): forward hooks on every module
  record each call as it happens (device tensors, no sync on a clean step).

**Adaptive mode** (``adaptive=True``) adds tensor hooks on the outputs recording whether the incoming gradient
was finite, for a *backward source*: the innermost module whose gradient arriving at its output was finite but
whose parameters' gradients were not, counted only when the whole forward was finite (else the module after
a forward source would be blamed) and the loss scale is already <= 1 (or scaling is off): above that, an
overflow in backward is the GradScaler's to fix by backing off, and it will.

A module that is a source for ``promote_after`` consecutive steps (default 3) while running in fp16 or bf16
is promoted to fp32 in the controller's copy of the policy (``controller.policy``) with a reason quoting what
was seen, the applied handle is updated in place, the change is logged (WARNING), and
``controller.save_policy(path)`` writes the updated policy. A source already in fp32 is reported once and
left alone (it is not a precision problem).

Works on a model wrapped by torch.compile (names and hooks are the inner model's; the forward hooks trace
without graph breaks, the adaptive backward hooks are skipped in compiled code; create the controller before
the first compiled forward, since hooks added to already-compiled code are not traced) and by DDP.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from ..errors import OptionError
from ..policy import Policy, named_modules, save_policy, unwrap_model
from ..policy.io import write_text_atomic
from .apply import (
    _ACTIVE,
    LOW_PRECISION_DTYPES,
    PolicyHandle,
    apply_policy,
    backward_tf32,
    make_grad_scaler,
    policy_tf32,
)
from .attribution import OUTSIDE_THE_MODEL, Attribution, _is_dtensor, _local, _ReplayProbe, _SourceProbe, stored_values
from .backward_tf32 import CONTROLLED
from .monitor import StabilityMonitor, StepRecord
from .readout import Readout
from .watch import Watch, apply_due, make_watch
from .watch_fp8 import delayed_modules

log = logging.getLogger(__name__)

#: A gradient overflow in backward counts towards promotion only once the loss scale is this low: above it,
#: the GradScaler backs off and the overflow goes away by itself.
BACKWARD_SOURCE_MAX_SCALE = 1.0
#: The schema id of a watch log (controller.save_watch).
WATCH_SCHEMA_ID = "precision-audit/watch"

#: The name under which gradients of optimizer parameters that are not the model's are reported.


def _found_any(found_infs: list[torch.Tensor], dev: torch.device) -> torch.Tensor:
    """The GradScaler's found-inf flags as one scalar on ``dev`` (0 when it has none)."""
    if not found_infs:
        return torch.zeros((), device=dev)
    if len(found_infs) == 1:
        return found_infs[0].to(dev).reshape(()).float()
    return torch.stack([v.to(dev).reshape(()) for v in found_infs]).sum().float()


class PrecisionController:
    """Runs each training step of a model trained under a policy: see the module docstring.

    Example::

        policy = pa.load_policy("audit/policy.json")
        handle = pa.apply_policy(model, policy)
        controller = pa.controller(model, optimizer, policy, adaptive=True)
        for x, y in loader:
            with pa.autocast(policy, "cuda"):
                loss = loss_fn(model(x), y)
            controller.step(loss)
        print(controller.monitor.summary())
        controller.save_policy("audit/policy.updated.json")   # with any promotions

    Arguments beyond ``policy, model, optimizer`` (keyword only): ``adaptive`` (promote modules that keep
    producing non-finite values to fp32), ``promote_after`` (consecutive steps, default 3), ``device``
    (the GradScaler's device type; default: the parameters'), ``max_grad_norm`` (clip the unscaled gradients
    to this total norm), ``process_group`` (for the distributed agreement; default: the default group),
    ``strict`` (refuse a model whose fingerprint differs; default True), ``monitor`` (a
    :class:`StabilityMonitor` to use) or ``spike_window`` / ``spike_factor`` (to configure a new one),
    ``attribute`` (default True: forward hooks that name the source of a non-finite step; False saves their
    cost on clean steps, and skipped steps are then still skipped and counted, without a source).
    ``watch`` (default False): record per-module amax and fp16 underflow every ``watch_every`` steps (default 10),
    forecast when a format's limit is crossed and act ``horizon`` steps (default 200) ahead when the forecast's
    confidence is at least ``min_confidence`` (default 0.9); ``watch_writer`` (a TensorBoard ``SummaryWriter``)
    gets the series as scalars (runtime/watch.py; docs/policy.md, "Watch and forecast"). Modules the policy's
    ``fp8`` plan puts under ``fp8_delayed`` are also forecast against that recipe's saturation, and replanned to
    ``fp8_rowwise`` before it (runtime/watch_fp8.py; docs/policy.md, "FP8 delayed scaling").
    """

    def __init__(self, policy: Policy, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 adaptive: bool = False, promote_after: int = 3, device: str | torch.device | None = None,
                 max_grad_norm: float | None = None, process_group: Any = None, strict: bool = True,
                 monitor: StabilityMonitor | None = None, spike_window: int = 50,
                 spike_factor: float = 3.0, attribute: bool = True, watch: bool = False, watch_every: int = 10,
                 horizon: int = 200, min_confidence: float = 0.9, watch_writer: Any = None) -> None:
        if not isinstance(policy, Policy):
            raise OptionError("the controller needs a Policy", found=type(policy).__name__)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise OptionError("the controller needs a torch.optim.Optimizer", found=type(optimizer).__name__)
        if not (isinstance(promote_after, int) and promote_after >= 1):
            raise OptionError("promote_after must be an integer >= 1", found=repr(promote_after))
        if max_grad_norm is not None and not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise OptionError("max_grad_norm must be a positive finite number or None", found=repr(max_grad_norm))
        if adaptive and not attribute:
            raise OptionError("adaptive=True needs attribute=True (promotion acts on the attributed source)",
                              found="attribute=False")
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
        self._params: list[torch.Tensor] = []
        self._module_params: list[tuple[str, list[torch.Tensor]]] = []
        for name, m in modules:
            own: list[torch.Tensor] = [p for p in m.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in own)
            self._params.extend(own)
            if own:
                self._module_params.append((name, own))
        # Parameters the optimizer updates that are not the model's (a learnable loss temperature, say): their
        # gradients are checked too, since a non-finite one would reach the optimizer just the same.
        outside = [p for g in optimizer.param_groups for p in g["params"]
                   if isinstance(p, torch.Tensor) and p.requires_grad and id(p) not in seen]
        outside = list({id(p): p for p in outside}.values())
        if outside:
            self._params.extend(outside)
            self._module_params.append((OUTSIDE_THE_MODEL, outside))
        if device is None:
            device = self._params[0].device.type if self._params else "cpu"
        self.device_type = torch.device(device).type if not isinstance(device, str) else device.split(":")[0]
        self.scaler = make_grad_scaler(policy, self.device_type)
        self._step = 0
        self._skipped = 0
        self._readout = Readout()
        self._streaks: dict[str, list[int]] = {}
        self._reported_fp32_sources: set[str] = set()
        self._own_handle: PolicyHandle | None = None
        # A skipped step names where its non-finite values started: by replaying its forward with per-call records
        # (nothing per module on clean steps), or, in adaptive mode (the backward-source rule needs the real
        # backward) and under torch.compile (the records join the compiled graph), with per-call records always
        # on (module docstring, "Source attribution"; docs/performance.md).
        self._probe: _SourceProbe | _ReplayProbe | None = None
        # FSDP2: a replayed forward would all-gather (collectives every rank must join), so per-call records
        self._sharded = any(_is_dtensor(p) for p in self._params)
        if attribute:
            if adaptive or type(model).__name__ == "OptimizedModule" or self._sharded:
                self._probe = _SourceProbe(modules, backward=adaptive)
            else:
                self._probe = _ReplayProbe(self.root, modules)
        self.watch: Watch | None = make_watch(watch, modules, every=watch_every, horizon=horizon,
                                              min_confidence=min_confidence, writer=watch_writer,
                                              fp8_delayed=delayed_modules(policy))
        CONTROLLED[self.root] = policy_tf32(policy)  # step() sets these for the backward (runtime/backward_tf32.py)
        if type(model).__name__ == "OptimizedModule":
            log.info("controller on a torch.compile'd model: its hooks are traced only by code compiled after "
                     "this point")

    # -- public ------------------------------------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        """The policy in effect, with any adaptive promotions (the one passed in is never modified)."""
        return self._policy

    @property
    def steps(self) -> int:
        return self._step

    @property
    def skipped_steps(self) -> int:
        """Steps whose optimizer update was skipped because a gradient was non-finite (a running count)."""
        return self._skipped

    def save_policy(self, path: str | os.PathLike[str]) -> None:
        """Write :attr:`policy` (with any promotions) to ``path`` atomically; with ``watch=True`` the watch's
        record (series, forecasts, actions) goes with it under the top-level key ``"watch"``."""
        policy = self._policy
        if self.watch is not None:
            policy = dataclasses.replace(policy, extra={**policy.extra, "watch": self.watch.to_dict()})
        save_policy(policy, path)

    def save_watch(self, path: str | os.PathLike[str]) -> None:
        """Write the watch's record alone as JSON (``precision-audit report`` renders it as a timeline)."""
        if self.watch is None:
            raise OptionError("save_watch needs a controller made with watch=True", found="watch=False")
        write_text_atomic(path, json.dumps({"schema": WATCH_SCHEMA_ID, "version": 1, "model": self._policy.model_class,
                                            **self.watch.to_dict()}, indent=1, allow_nan=False))

    def close(self) -> None:
        """Remove the controller's hooks (and a handle it applied itself). The scaler stays usable; later steps
        are still checked and skipped, but no longer name a source."""
        if self._probe is not None:
            self._probe.remove()
            self._probe = None
        if self._own_handle is not None:
            self._own_handle.remove()
            self._own_handle = None
        if self.watch is not None:
            self.watch.remove()
        CONTROLLED.pop(self.root, None)

    def step(self, loss: torch.Tensor) -> StepRecord:
        """Backward, unscale, non-finite check, optimizer step (skipped if any gradient is non-finite), scaler
        update, zero_grad; returns the step's record."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise OptionError("controller.step(loss) takes the loss as a one-element tensor",
                              found=type(loss).__name__ if not isinstance(loss, torch.Tensor) else
                              f"a tensor of shape {tuple(loss.shape)}")
        self._step += 1
        scaler = self.scaler
        attribution: Attribution | None = None
        nonfinite: tuple[str, ...] = ()
        skip = False
        try:
            with backward_tf32(self._policy):  # the forward's switches (overridden modules set their own)
                scaler.scale(loss).backward()
            scaler.unscale_(self.optimizer)
            norm, found_infs, seen = self._check(loss)
            loss_v, norm_v = seen["loss"], seen["norm"]
            found_v = seen.get("found_inf", 0.0)
            scale_used = seen["scale"] if "scale" in seen else None
            bad_norm = seen["bad_norm"] > 0 if "bad_norm" in seen else not math.isfinite(norm_v)
            bad = found_v > 0 or bad_norm
            if bad:  # every rank gets here together (the flags are agreed), so the collectives below match
                nonfinite, skip, attribution = self._on_bad_step(found_infs, found_v > 0, scale_used, loss.device)
            if not skip and self.max_grad_norm is not None:
                self._clip(norm)  # after the check: a non-finite norm would multiply every gradient by NaN
            self._optimizer_step(skip)
            scaler.update()
        finally:
            if self._probe is not None:
                self._probe.clear()
            if self.watch is not None:
                self.watch.arm(self._step + 1)
        self.optimizer.zero_grad(set_to_none=True)
        if skip:
            self._skipped += 1
            self._report_skip(loss_v, scale_used, nonfinite, attribution)
        sources: tuple[str, ...] = ()
        if attribution is not None:
            sources = ((attribution.source,) if attribution.source is not None else ()) + tuple(
                n for n in attribution.backward if n != attribution.source)
        promoted = self._adapt(attribution) if self.adaptive else ()
        if self.watch is not None and "watch" in seen:
            promoted += self._act(seen["watch"], scale_used)
        return self.monitor.observe(step=self._step, loss=loss_v, scale=scale_used, skipped=skip,
                                    grad_norm=norm_v, nonfinite_modules=nonfinite, sources=sources,
                                    promoted=promoted,
                                    source_detail=attribution.detail if attribution and attribution.source is not None
                                    else "")

    def _check(self, loss: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, Any]]:
        """The step's device values, read with its one device sync (runtime/readout.py): the loss, the total norm
        of the unscaled gradients (the non-finite gate without a GradScaler: one read of every gradient, as the
        hand-written check), the GradScaler's found-inf flag and scale; under torch.distributed the two flags
        are first all-reduced (MAX) so that every rank skips the same steps. Returns (norm, found_infs, values)."""
        dev = loss.device
        grads = []
        for p in self._params:
            g = p.grad
            if g is not None:
                grads.append(g if g.layout == torch.strided else stored_values(g))  # sparse: its values
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=dev)
        if _is_dtensor(norm):  # FSDP2: the norm of the shards, reduced across ranks (a collective)
            norm = norm.full_tensor()  # type: ignore[attr-defined]
        readout = self._readout
        readout.add("loss", loss)
        readout.add("norm", norm)
        found_infs = self._found_infs()
        if found_infs:
            readout.add("scale", self.scaler._scale)  # type: ignore[arg-type]  # the scale this step used
        watched = self.watch.pending(dev) if self.watch is not None else None
        if watched is not None:
            readout.add("watch", self._reduce_watch(watched))
        if self._distributed():
            import torch.distributed as dist

            flags = torch.stack([_found_any(found_infs, dev), (~torch.isfinite(norm.to(dev))).float()])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
            for v in found_infs:  # every rank now skips (and backs off) together
                v.copy_(flags[0].to(v.device).reshape(v.shape))
            readout.add("found_inf", flags[0])
            readout.add("bad_norm", flags[1])
        elif found_infs:
            readout.add("found_inf", _found_any(found_infs, dev))
        return norm, found_infs, readout.read()

    def _on_bad_step(self, found_infs: list[torch.Tensor], found: bool, scale_used: float | None,
                     dev: torch.device) -> tuple[tuple[str, ...], bool, Attribution | None]:
        """A step whose GradScaler found an inf or whose norm is not finite: which modules' gradients are non-finite
        (agreed across ranks; it decides the skip, since a norm can overflow from finite gradients) and where the
        values started. Returns (non-finite modules, skip, attribution)."""
        nonfinite = self._scan_modules()
        skip = found or bool(nonfinite)
        attribution = None
        if self._probe is not None:
            backward_counts = scale_used is None or scale_used <= BACKWARD_SOURCE_MAX_SCALE
            attribution = self._probe.evaluate({n for n in nonfinite if n != OUTSIDE_THE_MODEL}, backward_counts,
                                               dev, self._reduce_max,
                                               self._agree_text if self._distributed() else None)
        if skip and not found:
            # non-finite where the GradScaler does not look (parameters outside the optimizer): make it skip and
            # back off as it does for its own finds
            for v in found_infs:
                v.fill_(1.0)
        return nonfinite, skip, attribution

    def _optimizer_step(self, skip: bool) -> None:
        """The update: never with a non-finite gradient, whatever the format (docs/policy.md)."""
        scaler, opt = self.scaler, self.optimizer
        if not scaler.is_enabled():  # a disabled scaler's step() is a plain optimizer.step()
            if not skip:
                opt.step()
            return
        if getattr(opt, "_step_supports_amp_scaling", False):
            scaler.step(opt)  # a fused optimizer takes found_inf on the device (no sync)
            return
        # GradScaler.step would read found_inf again (a second device sync per step) to decide what the controller
        # has just decided with the same flags (skip == found_inf, agreed across ranks): step, or not, as it would
        if not skip:
            opt.step()
        self.scaler._per_optimizer_states[id(opt)]["stage"] = OptState.STEPPED

    # -- internals ---------------------------------------------------------------------------------------
    def _clip(self, norm: torch.Tensor) -> None:
        """Clip the gradients to ``max_grad_norm`` given their total ``norm``."""
        assert self.max_grad_norm is not None
        if not self._sharded:
            torch.nn.utils.clip_grads_with_norm_(self._params, self.max_grad_norm, norm)
            return
        # FSDP2's gradients are DTensor shards: scale each rank's shard by the global norm's factor
        coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
        for p in self._params:
            if p.grad is not None:
                _local(p.grad).mul_(coef.to(_local(p.grad).device, _local(p.grad).dtype))

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

    def _agree_text(self, text: str | None) -> str | None:
        """The lowest rank's non-None ``text`` (every rank calls this at the same point; bad steps only)."""
        import torch.distributed as dist

        texts: list[str | None] = [None] * dist.get_world_size(self.process_group)
        dist.all_gather_object(texts, text, group=self.process_group)
        return next((t for t in texts if t is not None), None)

    def _scan_modules(self) -> tuple[str, ...]:
        """The modules whose own parameter gradients hold inf/NaN on any rank (the same tuple on every rank: a
        rank of FSDP2 sees only its shards, and under DDP a rank may hold a gradient others do not)."""
        checks = []
        for _, params in self._module_params:
            gs = [stored_values(_local(p.grad)) for p in params if p.grad is not None]
            gs = [g for g in gs if g.numel()]
            checks.append(torch.stack([(~torch.isfinite(g).all()) for g in gs]).any().float() if gs else None)
        if not checks:
            return ()
        dev = next((c.device for c in checks if c is not None), torch.device("cpu"))
        flags = torch.stack([c.to(dev) if c is not None else torch.zeros((), device=dev) for c in checks])
        vals = self._reduce_max(flags).tolist()
        return tuple(name for (name, _), v in zip(self._module_params, vals) if v)

    def _report_skip(self, loss_v: float, scale: float | None, nonfinite: tuple[str, ...],
                      a: Attribution | None) -> None:
        """Log a skipped step: WARNING, except a GradScaler backoff from an overflow in the scaled backward
        (finite forward, scale above 1), which is the loss scaler's routine and logged at INFO."""
        where = (f" in {', '.join(n or '(root)' for n in nonfinite[:6])}{' ...' if len(nonfinite) > 6 else ''}"
                 if nonfinite else "")
        if a is not None and a.unreproduced:
            origin = f"no source named: the forward could not be replayed exactly ({a.unreproduced})"
        elif a is not None and a.source is not None:
            origin = f"they start in {a.source or '(root)'!r}: {a.detail}"
        elif a is not None and a.forward_nonfinite:
            origin = "no module turned finite inputs into non-finite outputs (the model's inputs were not finite)"
        elif a is not None and a.backward:
            origin = f"they start in the backward pass of {', '.join(repr(n) for n in a.backward)}"
        elif a is not None and not math.isfinite(loss_v):
            origin = "every module output was finite: they start in the loss"
        elif a is not None:
            origin = "every module output was finite: they start in the backward pass"
        else:
            origin = "no source recorded (attribute=False, or controller.close() removed the hooks)"
        routine = (scale is not None and scale > BACKWARD_SOURCE_MAX_SCALE and math.isfinite(loss_v)
                   and (a is None or not a.forward_nonfinite))
        level = logging.INFO if routine else logging.WARNING
        log.log(level, "step %d skipped: non-finite gradients%s; %s%s (%d step(s) skipped so far)", self._step,
                where, origin, f"; loss scale {scale:g} backs off" if scale is not None else "", self._skipped)

    def _adapt(self, a: Attribution | None) -> tuple[str, ...]:
        kinds: dict[str, str] = {}
        if a is not None and a.source is not None:
            kinds[a.source] = a.detail
        for n in (a.backward if a is not None else ()):
            kinds.setdefault(n, "its parameter gradients went non-finite from a finite output gradient at loss "
                                "scale <= 1")
        streaks = {n: self._streaks.get(n, []) + [self._step] for n in kinds}
        self._streaks = streaks
        promoted = []
        policy = self._policy
        for name in sorted(streaks):
            fmt = policy.effective_format(name)
            if fmt not in LOW_PRECISION_DTYPES:
                if name not in self._reported_fp32_sources:
                    self._reported_fp32_sources.add(name)
                    log.warning("adaptive precision: non-finite values start in %r (%s), which already runs in %s: "
                                "not a precision problem, nothing to promote", name or "(root)", kinds[name], fmt)
                continue
            steps = streaks[name]
            if len(steps) < self.promote_after:
                continue
            when = (f"at step {steps[0]}" if len(steps) == 1 else
                    f"in {len(steps)} consecutive steps ({', '.join(map(str, steps))})")
            reason = (f"promoted from {fmt} to fp32 by the adaptive controller at step {self._step}: {kinds[name]} "
                      f"{when}")
            policy = policy.with_override(name, "fp32", reason)
            promoted.append(name)
            del self._streaks[name]
            log.warning("adaptive precision: %r %s", name or "(root)", reason)
        if promoted:
            self._set_policy(policy)
        return tuple(promoted)

    def _reduce_watch(self, v: torch.Tensor) -> torch.Tensor:
        """Across ranks: the amaxes maxed, the underflow counts summed (runtime/watch.py's layout)."""
        if not self._distributed():
            return v
        import torch.distributed as dist

        assert self.watch is not None
        n = self.watch.n_amax
        amax, small = v[:n].nan_to_num(nan=-1.0), v[n:].nan_to_num(nan=0.0)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.process_group)
        dist.all_reduce(small, op=dist.ReduceOp.SUM, group=self.process_group)
        return torch.cat([torch.where(amax < 0, torch.full_like(amax, math.nan), amax), small])

    def _act(self, values: Any, scale: float | None) -> tuple[str, ...]:
        """Record the watch's reading, refresh its forecasts and carry out what is due (runtime/watch.py)."""
        assert self.watch is not None
        vals = values if isinstance(values, list) else [values]
        due = self.watch.record(self._step, vals, self._policy, scale)
        if not due:
            return ()
        policy, promoted = apply_due(self.watch, due, self._policy, self.scaler, self._step)
        if policy is not self._policy:
            self._set_policy(policy)
        return promoted

    def _set_policy(self, policy: Policy) -> None:
        self._policy = policy
        handle = _ACTIVE.get(self.root)
        if handle is not None:
            handle._reapply(policy)
        else:
            self._own_handle = apply_policy(self.model, policy, strict=False)
            log.info("adaptive precision: the policy was not applied to the model; the controller applied its "
                     "updated copy (controller.close() removes it)")
