"""The audit inside a Hugging Face ``Trainer`` (README.md, "In a Trainer").

Example::

    from precision_audit.integrations.transformers import PrecisionAuditCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[PrecisionAuditCallback(apply_policy=True, steps=0)])
    trainer.train()      # audits the first batch into <output_dir>/precision-audit/, then trains under the policy

How the first batch is caught: ``TrainerCallback`` events do not receive the batch (``on_step_begin`` gets no
inputs), and drawing one from ``train_dataloader`` in ``on_train_begin`` would advance the sampler and change
what the model trains on. So ``on_step_begin`` -- called once the step's batch is fetched and collated -- replaces
the model's ``forward`` (an instance attribute, as ``accelerate`` does) by a one-shot wrapper: the first forward in
training mode with gradients on -- the forward of the first training step, before its backward and the first
optimizer step -- receives exactly the inputs the Trainer feeds (collated, on the device, ``labels`` included),
puts the original ``forward`` back, audits the model on those inputs, applies the policy when asked, and then runs
the forward it was called for. Evaluation forwards (no gradients, eval mode) pass through untouched. The audit
leaves the model and the random state as they were (precision_audit/api.py), so training with the callback
(apply_policy=False) trains exactly as without it.

Nothing stays behind when training fails: the wrapper exists only from ``on_step_begin`` to the step's forward
(put back at that forward, at ``on_step_end`` and at ``on_train_end``), so a ``train()`` that fails before it (a
collation error, an empty dataset) leaves ``model.forward`` untouched and the model picklable. The Trainer has no
event for a failed step; the one window left, an error raised by the Trainer between ``on_step_begin`` and the
model's forward (another callback's ``on_step_begin``, moving the batch to the device), is closed by the next
callback: made into a ``Trainer`` (``on_init_end``) or at ``on_train_begin``, it puts back any wrapper an earlier
one left on the model.

In a distributed run only the main process audits; the others train on unchanged (apply_policy needs the
policy on every process, so it is single-process only). The Trainer's ``bf16=`` / ``fp16=`` flags are compared
with the plan and a conflict is logged as a warning (precision_audit/integrations/_common.py says how the
policy and the Trainer's autocast combine). The handle of an applied policy is removed in ``on_train_end``.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from ._common import (
    RunWatch,
    apply_for_training,
    check_against_trainer,
    check_audit_kwargs,
    run_audit_on,
    trainer_format,
    trainer_policy,
)

log = logging.getLogger(__name__)

#: The folder inside ``TrainingArguments.output_dir`` the outputs go to.
OUT_FOLDER = "precision-audit"


class PrecisionAuditCallback(TrainerCallback):
    """Audit the model on the first training batch; ``apply_policy=True`` then trains on under the policy.

    ``audit_kwargs`` go to :func:`precision_audit.audit` (``loss_fn``, ``target``, ``formats``, ``budget``,
    ``steps``, ``progress``, ...). After training starts, ``.result`` holds the audit's result, ``.handle`` the
    applied policy's handle and ``.notes`` the warnings about the Trainer's precision flags.

    Over the run (docs/integrations.md, "Over the run"): ``watch=True`` watches each module's amax and fp16
    underflow every ``watch_every`` steps, forecasts the first overflow and, with ``apply_policy=True``, promotes a
    module ``horizon`` steps ahead at ``min_confidence`` (``watch_writer``: a TensorBoard SummaryWriter);
    ``audit_every=K`` re-audits the first batch every K steps, and every checkpoint save re-audits too, into
    ``<output_dir>/precision-audit/step-<N>/``; ``.run.watch`` is the watch.
    """

    def __init__(self, apply_policy: bool = False, *, watch: bool = False, audit_every: int = 0,
                 watch_every: int = 10, horizon: int = 200, min_confidence: float = 0.9, watch_writer: Any = None,
                 **audit_kwargs: Any) -> None:
        if not isinstance(apply_policy, bool):
            from ..errors import OptionError

            raise OptionError("apply_policy must be True or False", found=repr(apply_policy))
        self.apply_policy = apply_policy
        self.audit_kwargs = check_audit_kwargs(audit_kwargs, "PrecisionAuditCallback")
        self.run = RunWatch(watch, audit_every, {"every": watch_every, "horizon": horizon,
                                                 "min_confidence": min_confidence, "writer": watch_writer})
        self._out: Path | None = None
        self._model: torch.nn.Module | None = None
        self._trainer_policy: Any = None
        self.result: Any = None
        self.handle: Any = None
        self.notes: list[str] = []
        self._restore: Any = None
        self._audit_call: Any = None  # set by on_train_begin: what the first training forward runs

    def on_init_end(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                    **kwargs: Any) -> None:
        # before train() reads the forward's signature (to drop the dataset's unused columns)
        if model is not None:
            _put_back_left_wrappers(model)  # an earlier train() that failed inside a step (module docstring)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                       **kwargs: Any) -> None:
        if model is not None:
            _put_back_left_wrappers(model)
        if self.result is not None or model is None:
            return
        if not state.is_world_process_zero:
            log.info("precision-audit: the main process audits; this one trains on unchanged")
            return
        out = Path(args.output_dir) / OUT_FOLDER
        fmt = trainer_format(bool(args.bf16), bool(args.fp16))
        flag = f"bf16={bool(args.bf16)}, fp16={bool(args.fp16)}"
        self._audit_call = functools.partial(self._audit, model, out, fmt, flag)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.run.begin_step(state.global_step + 1)
        # the step's batch is fetched and collated by now: a failure there left nothing to undo
        if self._audit_call is not None and self._restore is None and self.result is None:
            self._restore = _first_training_forward(self._audit_call.args[0], self._audit_call)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._put_back()  # a step that ran no training forward: the next step's on_step_begin wraps again
        model = self._model
        if model is None:
            return
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.handle = self.run.end_step(state.global_step, device, self.handle, self._trainer_policy)
        if self.run.audit_every and state.global_step % self.run.audit_every == 0 and self._out is not None:
            self.handle = self.run.reaudit(model, state.global_step, self._out, self.audit_kwargs, self.handle)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._model is not None and self._out is not None and (self.run.on or self.run.audit_every):
            self.handle = self.run.reaudit(self._model, state.global_step, self._out, self.audit_kwargs, self.handle)

    def _audit(self, model: torch.nn.Module, out: Path, fmt: str, flag: str, batch: Any) -> None:
        self._restore = self._audit_call = None
        self.result = run_audit_on(model, batch, out, self.audit_kwargs)
        self.notes = check_against_trainer(self.result.policy, fmt, flag, self.apply_policy)
        if self.apply_policy:
            self.handle = apply_for_training(self.result.policy, model)
        self._out, self._model = out, model
        self._trainer_policy = trainer_policy(self.result.policy, fmt)
        self.run.start(model, batch)

    def _put_back(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._put_back()  # training ended before any training forward
        self._audit_call = None
        if self._out is not None:
            self.run.finish(self._out)
        if self.handle is not None:
            self.handle.remove()


#: The attribute that marks this module's forward wrapper, with the function that puts the previous forward back.
_MARK = "__precision_audit_restore__"


def _put_back_left_wrappers(model: torch.nn.Module) -> None:
    """Put back the forward that a wrapper of an earlier callback replaced, if one is still on ``model``."""
    for _ in range(16):  # wrappers an earlier callback left, outermost first
        restore = getattr(model.__dict__.get("forward"), _MARK, None)
        if restore is None:
            return
        log.info("precision-audit: the model's forward was still wrapped by an earlier callback's train() that "
                 "failed; put back")
        restore()


def _first_training_forward(model: torch.nn.Module, audit: Any) -> Any:
    """Wrap ``model.forward`` so that its first training call audits its inputs first; returns the undo."""
    had = "forward" in model.__dict__
    previous: Any = model.__dict__.get("forward")  # the instance's own forward, if it had one

    def restore() -> None:
        if model.__dict__.get("forward") is wrapper:
            if had:
                model.forward = previous
            else:
                del model.__dict__["forward"]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if model.training and torch.is_grad_enabled():
            restore()
            batch = _as_batch(args, kwargs)
            if batch is not None:
                audit(batch)
            return model.forward(*args, **kwargs)
        return (previous if had else type(model).forward.__get__(model))(*args, **kwargs)

    setattr(wrapper, _MARK, restore)
    model.forward = wrapper
    return restore


def _as_batch(args: tuple, kwargs: dict) -> Any:
    """The forward's inputs as a batch ``audit()`` takes: the keyword dict, or the positional inputs."""
    if kwargs and not args:
        return dict(kwargs)
    if args and not kwargs:
        return args[0] if len(args) == 1 else tuple(args)
    log.warning("precision-audit: the first training forward got %s; the audit takes positional or keyword "
                "inputs, not both, so it did not run", "no inputs" if not args else "both kinds of inputs")
    return None
