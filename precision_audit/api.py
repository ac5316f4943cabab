"""The audit of live objects: ``precision_audit.audit(model, batch)`` from a script, a notebook or a trainer.

The same core as the command line (:func:`precision_audit.audit.compute_audit`), fed an ``nn.Module`` and a batch
in memory instead of MODEL and BATCH files (README.md, "From Python"). The batch takes the shapes a BATCH file
takes (a tensor, a tuple/list ``(inputs..., target)``, a dict of keyword inputs) and the loss is resolved in the
same order: ``loss_fn`` -> the model's own ``output.loss`` -> cross-entropy / MSE from the target -> a surrogate
(precision_audit/loading.py).

The model is left exactly as it was: the passes run on the model itself and put back what they change, the
random generators forked (capture/session.py, capture/model_state.py; docs/memory.md), and the batch is copied
before the audit sees it. The caller's context is set aside and put back: called inside the caller's
``torch.autocast`` (or ``no_grad`` / ``inference_mode``) the audit still runs its FP32 reference in plain FP32
with gradients, and the caller's autocast, grad mode and TF32 switches are as they were when it returns. One
model is audited by one call at a time: a second call on the same model (or on a module inside it) from another
thread, or from inside the first, is refused (:class:`~precision_audit.errors.ModelInUseError`), since both
would hook and swap the same modules.

Example::

    import precision_audit
    result = precision_audit.audit(model, (x, y), out="audit")
    print(result.summary())
    handle = precision_audit.apply_policy(model, result.policy)
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from .analysis.findings import Budget
from .audit import _OUT_FOLDERS, AuditOptions, AuditResult, Subject, _absolute, _out_path, compute_audit, result_of
from .errors import BatchError, LossError, ModelInUseError, ModelLoadError, OptionError
from .loading import ModelSource, _interpret, check_trainable, model_exit_error
from .loading.nested import check_nesting
from .options import _short_repr
from .outputs import check_out_dir
from .policy.schema import unwrap_model
from .tf32_switches import restore as restore_tf32
from .tf32_switches import snapshot as snapshot_tf32

log = logging.getLogger(__name__)

#: How the batch is named in messages and in audit.json's ``batch.source``.
BATCH_LABEL = "audit(batch=...)"


@dataclass(frozen=True)
class _LiveSource(ModelSource):
    """A model handed to :func:`audit` as an object: no file; ``loss_fn`` is the argument of that name."""

    @property
    def where(self) -> str:
        return "audit()"

    @property
    def label(self) -> str:
        return f"{self.attribute} object passed to audit()"


def audit(
    model: torch.nn.Module,
    batch: Any,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: str | None = None,
    formats: Any = None,
    budget: Budget | Mapping[str, float] | None = None,
    out: str | os.PathLike[str] | None = None,
    progress: bool | Callable[[str], None] = True,
    device: str = "auto",
    emulate: bool = False,
    steps: int = 1,
    seed: int = 0,
    kernels: str = "auto",
    trace: bool = False,
) -> AuditResult:
    """Audit ``model`` on ``batch`` in memory; returns the :class:`~precision_audit.audit.AuditResult`.

    - ``batch``: a tensor (the one input), a tuple/list (``inputs...`` or ``(inputs..., target)``, split with
      the forward's signature), or a dict of keyword inputs, as a BATCH file.
    - ``loss_fn(output, batch)``: the loss to differentiate (``batch`` as given here); by default the model's
      ``output.loss``, else cross-entropy / MSE inferred from the target, else a fixed surrogate.
    - ``target``: the GPU to plan for (``"h100"``, ``"a100"``, ...; default: this machine's GPU, else H100);
      ``formats``: ``"fp16,bf16"`` or a list; ``budget``: a :class:`Budget` or a dict of its fields.
    - ``out``: a folder to save audit.json, policy.json, report.html and ``tb/`` into (all or nothing); without
      it nothing is written (call ``result.save(folder)`` later).
    - ``progress``: True shows a ``tqdm.auto`` progress bar (a widget in Jupyter), False nothing, or a
      callable taking each stage's message.
    - ``device``, ``emulate``, ``steps``, ``seed``, ``kernels``, ``trace``: as the command line's options of those
      names.

    ``model`` is left exactly as it was (parameters, buffers, gradients, modes, hooks, random state), and so is
    the caller's context (autocast, grad mode, TF32 switches): inside the caller's ``torch.autocast`` the audit's
    FP32 reference is still FP32. Bad arguments raise an :class:`~precision_audit.errors.AuditError` subclass
    before anything runs; so does a second audit of a model being audited (another thread's, or this one's).
    """
    inner, batch_raw, fn, budget_obj, shown = _check_arguments(model, batch, loss_fn, budget, progress)
    with _one_audit_at_a_time(inner), _plain_fp32_context():
        return _audit(inner, batch_raw, fn, budget_obj, shown, target=target, formats=formats, out=out,
                      device=device, emulate=emulate, steps=steps, seed=seed, kernels=kernels, trace=trace)


def _audit(inner: torch.nn.Module, batch_raw: Any, fn: Any, budget_obj: Budget, shown: bool | Callable[[str], None],
           *, target: str | None, formats: Any, out: str | os.PathLike[str] | None, device: str, emulate: bool,
           steps: int, seed: int, kernels: str, trace: bool) -> AuditResult:
    if out is not None:
        out = _out_path(out)
        check_out_dir(out, _OUT_FOLDERS)
    name = type(inner).__name__
    source = _LiveSource(spec=f"{name} object passed to audit()", path=None, attribute=name,
                         module=_loss_module(fn))
    opts = AuditOptions(model=source.spec, batch=None, out=_absolute(out) if out is not None else Path("audit"),
                        target=target, formats=formats, device=device, emulate=emulate, steps=steps, seed=seed,
                        budget=budget_obj, kernels=kernels, trace=trace)
    check_trainable(inner, source)
    check_nesting(batch_raw, BATCH_LABEL)
    subject = Subject(inner, source, _interpret(_copy_tensors(batch_raw, {}), inner, BATCH_LABEL))
    # the bar is made when the audit starts, after the arguments are checked
    say: Callable[[str], None] | None = (TqdmProgress() if shown is True else None if isinstance(shown, bool)
                                         else shown)
    try:
        try:
            c = compute_audit(opts, say, subject=subject)
        except SystemExit as e:
            raise model_exit_error(e, source.spec) from e
    finally:
        close = getattr(say, "close", None)
        if callable(close):
            close()
    result = result_of(c)
    result.record.options.out = None if out is None else str(out)
    if out is not None:
        result.save(out)
    return result


#: The modules of the models being audited now (by id; each entry is alive while its audit runs): a second audit of
#: any of them is refused. Guarded by _RUNNING_LOCK.
_RUNNING: dict[int, str] = {}
_RUNNING_LOCK = threading.Lock()


@contextlib.contextmanager
def _one_audit_at_a_time(model: torch.nn.Module) -> Iterator[None]:
    """Refuse to audit ``model`` while another audit runs on it or on a module they share: both would register
    hooks on the same modules and swap their forwards and buffers, each undoing the other's (wrong summaries, a
    hook left on the model)."""
    ids = {id(m) for m in model.modules()}
    me = threading.current_thread().name
    with _RUNNING_LOCK:
        busy = ids & _RUNNING.keys()
        if busy:
            where = ", ".join(sorted({_RUNNING[i] for i in busy}))
            raise ModelInUseError(
                f"this {type(model).__name__} is being audited already",
                found=f"an audit running in thread {where!r} on {len(busy)} of its {len(ids)} module(s)",
                hint="audit one model at a time: wait for the running audit (or audit a copy: copy.deepcopy(model))")
        for i in ids:
            _RUNNING[i] = me
    try:
        yield
    finally:
        with _RUNNING_LOCK:
            for i in ids:
                _RUNNING.pop(i, None)


#: The device types torch.autocast knows; the caller's autocast is switched off on each that has it on.
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "ipu", "privateuseone")


@contextlib.contextmanager
def _plain_fp32_context() -> Iterator[None]:
    """The caller's context set aside for the audit: no autocast (the FP32 reference must be FP32; the audit sets
    its own autocast for each format), gradients on (outside any ``no_grad`` / ``inference_mode``); and the TF32
    switches as they were, whatever the audit or the model changed. Each is put back on the way out."""
    tf32 = snapshot_tf32()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.enable_grad())
            for device in _AUTOCAST_DEVICES:
                try:
                    on = torch.is_autocast_enabled(device)
                except (RuntimeError, ValueError):  # a device type this torch does not know
                    continue
                if on:
                    stack.enter_context(torch.autocast(device, enabled=False))
            yield
    finally:
        restore_tf32(tf32)


def _check_arguments(model: Any, batch: Any, loss_fn: Any, budget: Any, progress: Any
                     ) -> tuple[torch.nn.Module, Any, Any, Budget, bool | Callable[[str], None]]:
    if not isinstance(model, torch.nn.Module):
        raise ModelLoadError("audit(model, batch) takes the model as a torch.nn.Module",
                             expected="an instance of torch.nn.Module (the model itself, not its class or a "
                                      "state_dict)",
                             found=f"{type(model).__name__}: {_short_repr(model)}",
                             hint="pass the module you train, e.g. audit(model, batch)")
    if batch is None:
        raise BatchError("audit(model, batch) needs a batch",
                         expected="a tensor, a tuple/list (inputs..., target), or a dict of keyword inputs",
                         found="None", hint="pass one batch from your data loader")
    if loss_fn is not None and not callable(loss_fn):
        raise LossError("loss_fn is not callable", expected="None, or a function loss_fn(output, batch) -> scalar "
                        "tensor", found=f"{type(loss_fn).__name__}: {_short_repr(loss_fn)}")
    if budget is None:
        budget_obj = Budget()
    elif isinstance(budget, Budget):
        budget_obj = budget
    elif isinstance(budget, Mapping):
        fields = ("max_loss_rel_change", "max_output_rel_error")
        unknown = [k for k in budget if k not in fields]
        if unknown:
            raise OptionError(f"unknown budget field(s): {', '.join(map(str, unknown))}", choices=fields)
        try:
            budget_obj = Budget(**budget)
        except ValueError as e:
            raise OptionError("budget is out of range", expected="positive finite numbers", found=str(e)) from e
    else:
        raise OptionError("budget has the wrong type",
                          expected="None, a precision_audit.analysis.findings.Budget, or a dict with "
                                   "max_loss_rel_change and/or max_output_rel_error",
                          found=f"{type(budget).__name__}: {_short_repr(budget)}")
    if not isinstance(progress, bool) and not callable(progress):
        raise OptionError("progress has the wrong type", expected="True, False, or a callable taking a message",
                          found=f"{type(progress).__name__}: {_short_repr(progress)}")
    return unwrap_model(model), batch, loss_fn, budget_obj, progress


def _loss_module(loss_fn: Any) -> types.ModuleType:
    """The namespace the loss resolution reads ``loss_fn`` from (a model file's module on the file path)."""
    module = types.ModuleType("audit()")
    if loss_fn is not None:
        module.loss_fn = loss_fn  # type: ignore[attr-defined]
    return module


def _copy_tensors(value: Any, memo: dict[int, torch.Tensor]) -> Any:
    """The batch with every tensor copied (a tensor shared between places stays shared): an in-place op in the
    forward, or a batch the caller changes later, cannot reach the caller's tensors or the audit's."""
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            with torch.no_grad():
                memo[id(value)] = value.detach().clone().requires_grad_(value.requires_grad)
        return memo[id(value)]
    if isinstance(value, Mapping):
        items = {k: _copy_tensors(v, memo) for k, v in value.items()}
        try:
            return cast(Any, type(value))(items)  # the caller's mapping type, if it takes a dict
        except TypeError:
            return items
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_copy_tensors(v, memo) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_copy_tensors(v, memo) for v in value)
    return value


class TqdmProgress:
    """Progress for :func:`audit`: one ``tqdm.auto`` bar (a widget in Jupyter with ipywidgets, text elsewhere) that
    counts the audit's stages and names the current one; ``close()`` finishes it."""

    def __init__(self) -> None:
        import importlib.util

        if importlib.util.find_spec("ipywidgets") is None:
            # tqdm.auto in a Jupyter kernel without ipywidgets warns "IProgress not found" (a red box) before it
            # falls back to this text bar: take the text bar ourselves (README.md, "In a notebook")
            from tqdm.std import tqdm
        else:
            from tqdm.auto import tqdm
        self._bar = tqdm(total=None, desc="precision-audit", unit="stage",
                         bar_format="{desc} [{n_fmt} stages, {elapsed}]", leave=True)

    def __call__(self, message: str) -> None:
        self._bar.set_description_str(f"precision-audit: {message}", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
