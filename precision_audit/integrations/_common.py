"""What the trainer callbacks share: auditing inside a training step, and training on under the policy.

The audit runs inside the trainer's step (the Hugging Face callback from within the model's first training
forward, the Lightning one from ``on_train_batch_start``), so the trainer's own mixed precision may be active
around it: autocast is switched off for the audit, whose FP32 reference must be plain FP32, and a forward that
``accelerate`` wrapped in its own autocast is set aside for the audit and put back after (the model object is
otherwise untouched: the audit runs on a copy, precision_audit/api.py).

Training under the policy (``apply_policy=True``): ``apply_policy(model, policy)`` puts each module the plan
overrides in its format, and the plan's default format goes on each top-level submodule the plan does not name, as
an override of its own. The policy's formats then hold inside the model whatever autocast the trainer runs around
it (an inner autocast wins over an outer one); the ops of the model's own forward outside any submodule (and
of the training step: the loss) run as the trainer runs them. The trainer's loss scaling is the trainer's:
fp16 modules want ``fp16=True`` (Hugging Face) / ``precision="16-mixed"`` (Lightning) for their GradScaler.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import OptionError

log = logging.getLogger("precision_audit.integrations")


class _UntilConfigured(logging.StreamHandler):
    """stderr for the callbacks' records while the application has configured no logging of its own.

    Python's default (no ``logging.basicConfig``) shows WARNING and above only, so the summary logged at INFO was
    invisible in a plain training script. Lightning and transformers give their own loggers a handler and the
    INFO level for the same reason; this one steps aside once the root logger has a handler, so a configured
    application sees each record once, through its own handlers."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


if not any(isinstance(h, _UntilConfigured) for h in log.handlers):
    log.addHandler(_UntilConfigured())
if log.level == logging.NOTSET:
    log.setLevel(logging.INFO)

#: The audit() arguments a callback fills in itself.
_OWN = ("model", "batch", "out")
DEFAULT_REASON = "the policy's default format, put on this top-level module by the training callback"


def check_audit_kwargs(kwargs: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """Refuse, when the callback is made (not at the first batch), an argument ``audit()`` does not take."""
    from ..api import audit

    accepted = [p for p in inspect.signature(audit).parameters if p not in _OWN]
    unknown = [k for k in kwargs if k not in accepted]
    if unknown:
        raise OptionError(f"{owner} got argument(s) audit() does not take: {', '.join(unknown)}",
                          choices=accepted, hint="the callback chooses the model, the batch and the output folder")
    return dict(kwargs)


@contextlib.contextmanager
def plain_fp32(model: torch.nn.Module) -> Iterator[None]:
    """Inside a training step: autocast off, gradients on, and accelerate's autocast forward set aside."""
    saved = model.__dict__.get("forward", None)
    original = model.__dict__.get("_original_forward")
    if saved is not None and original is not None:
        model.forward = original  # accelerate keeps the forward it wrapped here (its prepare_model)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autocast("cpu", enabled=False))
            if torch.cuda.is_available():
                stack.enter_context(torch.autocast("cuda", enabled=False))
            yield
    finally:
        if saved is not None and original is not None:
            model.forward = saved


def _stage(message: str) -> None:
    log.debug("precision-audit: %s", message)


def run_audit_on(model: torch.nn.Module, batch: Any, out: Path, audit_kwargs: dict[str, Any]) -> Any:
    """Audit ``model`` on ``batch`` into ``out`` and log the summary; returns the result.

    The trainer draws its own progress bar: the audit's stages go to the log (DEBUG) unless ``progress=`` was
    passed, so no bar is nested in the trainer's."""
    from ..api import audit

    kwargs = {"progress": _stage, **audit_kwargs}
    log.info("precision-audit: auditing %s on the first training batch (outputs in %s)", type(model).__name__, out)
    with plain_fp32(model):
        result = audit(model, batch, out=out, **kwargs)
    log.info("precision-audit on the first training batch (outputs in %s):\n%s", out, result.summary())
    return result


def trainer_format(bf16: bool, fp16: bool) -> str:
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


def check_against_trainer(policy: Any, trainer_fmt: str, flag: str, apply: bool) -> list[str]:
    """Warnings (logged, and returned) where the trainer's own precision setting disagrees with the plan.

    A conflict is a trainer set to bf16 or fp16 while the plan's default is another format; with the trainer
    in plain fp32 the plan's default is only reported (at INFO) when the policy is not applied."""
    notes = []
    default = policy.default_format
    if trainer_fmt in ("bf16", "fp16") and trainer_fmt != default:
        then = ("the policy's formats are put on the model's modules and win inside them"
                if apply else f"training goes on in {trainer_fmt} as the trainer is set, not as the plan says")
        notes.append(f"the trainer runs {trainer_fmt} ({flag}), but the precision audit's plan runs {default} by "
                     f"default: {then}; set the trainer's precision to match the plan to silence this")
    elif not apply and trainer_fmt != default:
        log.info("precision-audit: the plan runs %s by default; training goes on in %s as the trainer is set "
                 "(apply_policy=True trains under the plan)", default, trainer_fmt)
    if apply and policy.loss_scaling.enabled and trainer_fmt != "fp16":
        notes.append(f"the plan runs modules in fp16, which needs loss scaling (initial scale "
                     f"{policy.loss_scaling.init_scale:g}), but the trainer scales the loss only in fp16 mode "
                     f"({flag}): fp16 gradients may flush to zero")
    for n in notes:
        log.warning("precision-audit: %s", n)
    return notes


def training_policy(policy: Any, model: torch.nn.Module) -> Any:
    """The policy with its default format added as an override on each top-level submodule it does not name
    (on the model itself when it has none)."""
    from ..model_names import unwrap_model
    from ..policy.schema import ModuleOverride

    root = unwrap_model(model)
    children = [name for name, _ in root.named_children()] or [""]
    extra = {name: ModuleOverride(policy.default_format, DEFAULT_REASON) for name in children
             if name not in policy.modules}
    return dataclasses.replace(policy, modules={**extra, **policy.modules})


def trainer_policy(policy: Any, fmt: str) -> Any:
    """``policy`` as the trainer runs the model when the policy is not applied: every module in ``fmt``."""
    return dataclasses.replace(policy, default_format=fmt, modules={})


def apply_for_training(policy: Any, model: torch.nn.Module) -> Any:
    """Put the model under ``policy`` for the rest of training; returns the handle (``.remove()`` undoes it)."""
    from ..runtime.api import apply_policy

    handle = apply_policy(model, training_policy(policy, model))
    log.info("precision-audit: training goes on under the policy (%d module(s) overridden, default %s)",
             len(handle.modules), policy.default_format)
    return handle


class RunWatch:
    """What ``watch=True`` and ``audit_every=K`` add to a trainer callback (docs/integrations.md, "Over the run").

    The watch (precision_audit/runtime/watch.py) records on the trainer's steps as the controller's does: armed before
    a watched step, read once at its end (the trainer has synchronised there already for its own logging). The
    trainer keeps its own loss scaling, so gradient amaxes are recorded as the backward saw them (scaled, when the
    trainer scales the loss) and no loss-scale forecast is made; promotions change the applied policy
    (``apply_policy=True``; without it they are forecast and logged, not applied). Re-audits run on the first
    training batch (kept for that: each audit of the run sees the same inputs) into ``<out>/step-<N>/``, every
    ``audit_every`` steps and at each checkpoint save; ``<out>/watch.json`` is written at the end of training.
    """

    def __init__(self, watch: bool, audit_every: int, watch_options: Mapping[str, Any]) -> None:
        if not isinstance(watch, bool):
            raise OptionError("watch must be True or False", found=repr(watch))
        if not (isinstance(audit_every, int) and not isinstance(audit_every, bool) and audit_every >= 0):
            raise OptionError("audit_every must be an integer >= 0 (0: no re-audits)", found=repr(audit_every))
        from ..runtime.watch import Watch

        Watch([], **watch_options)  # the options checked when the callback is made
        self.on, self.audit_every, self.options = watch, audit_every, dict(watch_options)
        self.watch: Any = None
        self.batch: Any = None
        self.audited: set[int] = set()

    def start(self, model: torch.nn.Module, batch: Any) -> None:
        from ..policy import named_modules, unwrap_model
        from ..runtime.watch import Watch

        self.batch = batch
        if self.on and self.watch is None:
            self.watch = Watch(list(named_modules(unwrap_model(model))), **self.options)  # armed: step 1

    def begin_step(self, step: int) -> None:
        if self.watch is not None:
            self.watch.arm(step)

    def end_step(self, step: int, device: torch.device, handle: Any, trainer_policy: Any) -> Any:
        """Read the step's values (a watched step), refresh the forecasts, apply promotions to ``handle``'s policy
        (without one, forecast against ``trainer_policy``, the formats the trainer runs, and apply nothing); returns
        the handle."""
        w = self.watch
        if w is None:
            return handle
        vec = w.pending(device)
        if vec is None:
            return handle
        from ..runtime.watch import apply_due, describe

        policy = handle.policy if handle is not None else trainer_policy
        due = w.record(step, vec.tolist(), policy, None)
        if due and handle is None:
            for d in due:
                log.warning("precision-audit watch: %s", describe(d["module"], d["format"], d["kind"], d["forecast"],
                                                                  step))
        elif due:
            new, _ = apply_due(w, due, policy, None, step)
            if new is not policy:
                handle._reapply(new)
        return handle

    def reaudit(self, model: torch.nn.Module, step: int, out: Path, audit_kwargs: dict[str, Any],
                handle: Any) -> Any:
        """Audit the model on the first batch into ``out/step-<step>/`` (once per step); the applied policy comes off
        for the audit (its FP32 reference must be plain FP32) and back on after. Returns the handle."""
        if self.batch is None or step in self.audited:
            return handle
        self.audited.add(step)
        policy = handle.policy if handle is not None else None
        if handle is not None:
            handle.remove()
        try:
            with self.watch.paused() if self.watch is not None else contextlib.nullcontext():
                run_audit_on(model, self.batch, out / f"step-{step}", audit_kwargs)
        finally:
            if policy is not None:
                from ..runtime.api import apply_policy

                handle = apply_policy(model, policy)
        return handle

    def finish(self, out: Path) -> None:
        if self.watch is None:
            return
        import json

        from ..policy.io import write_text_atomic
        from ..runtime.controller import WATCH_SCHEMA_ID

        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / "watch.json", json.dumps({"schema": WATCH_SCHEMA_ID, "version": 1,
                                                          **self.watch.to_dict()}, indent=1, allow_nan=False))
        self.watch.remove()
        self.watch = None
