"""The audit inside a Lightning ``Trainer`` (README.md, "In a Trainer"); needs ``pip install lightning``
(the ``lightning`` extra).

Example::

    from precision_audit.integrations.lightning import PrecisionAuditCallback
    trainer = L.Trainer(max_steps=100, callbacks=[PrecisionAuditCallback(apply_policy=True)])
    trainer.fit(module, train_loader)   # audits the first batch into <default_root_dir>/precision-audit/

Lightning hands the batch to ``on_train_batch_start`` (already on the module's device), before
``training_step`` runs, so before the first optimizer step. The audit runs the LightningModule's ``forward``
on that batch as a BATCH file is read: ``(x, y)`` becomes input ``x`` and target ``y`` when ``forward(x)`` takes
one input, a dict becomes keyword inputs (precision_audit/loading/batch.py). Pass ``loss_fn(output, batch)`` (the batch
as the training step gets it) when the loss your ``training_step`` computes is not the one inferred. Only
global rank 0 audits; apply_policy is single-process only. The trainer's ``precision=`` is compared with the
plan and a conflict is logged as a warning (precision_audit/integrations/_common.py); the handle of an applied
policy is removed in ``on_train_end``, or in ``on_exception`` when training fails.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from ..errors import OptionError
from ._common import (
    RunWatch,
    apply_for_training,
    check_against_trainer,
    check_audit_kwargs,
    run_audit_on,
    trainer_policy,
)

log = logging.getLogger(__name__)

#: The folder inside the trainer's ``default_root_dir`` the outputs go to (unless ``out=`` names one).
OUT_FOLDER = "precision-audit"


class PrecisionAuditCallback(Callback):
    """Audit the LightningModule on the first training batch; ``apply_policy=True`` then trains under the policy.

    ``out`` overrides the output folder; ``audit_kwargs`` go to :func:`precision_audit.audit`. After the first
    batch ``.result`` holds the audit's result, ``.handle`` the applied policy's handle and ``.notes`` the
    warnings about the trainer's precision.

    Over the run (docs/integrations.md, "Over the run"): ``watch``, ``watch_every``, ``horizon``,
    ``min_confidence``, ``watch_writer`` and ``audit_every`` as the Hugging Face callback's; re-audits and the
    watch log go to ``<out>/step-<N>/`` and ``<out>/watch.json``.
    """

    def __init__(self, apply_policy: bool = False, out: str | Path | None = None, *, watch: bool = False,
                 audit_every: int = 0, watch_every: int = 10, horizon: int = 200, min_confidence: float = 0.9,
                 watch_writer: Any = None, **audit_kwargs: Any) -> None:
        if not isinstance(apply_policy, bool):
            raise OptionError("apply_policy must be True or False", found=repr(apply_policy))
        self.apply_policy = apply_policy
        self.out = Path(out) if out is not None else None
        self.audit_kwargs = check_audit_kwargs(audit_kwargs, "PrecisionAuditCallback")
        self.run = RunWatch(watch, audit_every, {"every": watch_every, "horizon": horizon,
                                                 "min_confidence": min_confidence, "writer": watch_writer})
        self._out: Path | None = None
        self._trainer_policy: Any = None
        self.result: Any = None
        self.handle: Any = None
        self.notes: list[str] = []
        self._done = False

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._done:
            self.run.begin_step(trainer.global_step + 1)
            return
        self._done = True
        if trainer.global_rank != 0:
            log.info("precision-audit: global rank 0 audits; this process trains on unchanged")
            return
        out = self.out if self.out is not None else Path(trainer.default_root_dir) / OUT_FOLDER
        self.result = run_audit_on(pl_module, batch, out, self.audit_kwargs)
        precision = str(trainer.precision)
        fmt = "bf16" if precision.startswith("bf16") else "fp16" if precision.startswith("16") else "fp32"
        self.notes = check_against_trainer(self.result.policy, fmt, f"precision={precision!r}", self.apply_policy)
        if self.apply_policy:
            self.handle = apply_for_training(self.result.policy, pl_module)
        self._out = out
        self._trainer_policy = trainer_policy(self.result.policy, fmt)
        self.run.start(pl_module, batch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._out is None:
            return
        step = trainer.global_step
        device = next((p.device for p in pl_module.parameters()), None)
        if device is not None:
            self.handle = self.run.end_step(step, device, self.handle, self._trainer_policy)
        if self.run.audit_every and step % self.run.audit_every == 0:
            self.handle = self.run.reaudit(pl_module, step, self._out, self.audit_kwargs, self.handle)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self._out is not None and (self.run.on or self.run.audit_every):
            self.handle = self.run.reaudit(pl_module, trainer.global_step, self._out, self.audit_kwargs, self.handle)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._out is not None:
            self.run.finish(self._out)
        if self.handle is not None:
            self.handle.remove()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Training failed (or was interrupted): the policy's wrapped forwards come off the model, as at its end."""
        self.on_train_end(trainer, pl_module)
