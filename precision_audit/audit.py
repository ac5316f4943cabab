"""The one straight-line pipeline: load -> hardware & target -> capture -> analysis -> plan -> outputs.

Only this module sees every stage; each stage's result goes into the audit's record (precision_audit/record/__init__.py)
through precision_audit/assemble.py, and the record becomes audit.json in one place (record/codec.py).
docs/record.md says which stage fills which section. Example::

    from precision_audit import AuditOptions, run_audit
    result = run_audit(AuditOptions(model="sample_models/mlp/model.py", batch="sample_models/mlp/sample.pt"))
    result.exit_code, result.files, result.record.verdict.message

The module is also callable: ``precision_audit.audit(model, batch, ...)`` audits live objects through the same
:func:`compute_audit` (precision_audit/api.py; README.md, "From Python").
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import logging
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import _AuditModule, assemble
from . import record as R
from .analysis.alignment import rank_alignment, tied_modules
from .analysis.findings import Analysis
from .analysis.gemm_timing import measure_gemms_on_gpu
from .analysis.loss_scale import recommend_fp16_loss_scale
from .analysis.performance import Performance, performance
from .capture import CaptureConfig, CaptureSession
from .capture.noise import NoiseFloor, measure_noise_floor
from .capture.records import CaptureResult, RunRecord
from .capture.stats import SCALE_EXPONENTS
from .errors import ModelRunError, OptionError
from .formats import Format
from .fp8.audit import fp8_stage
from .fp8.audit import requested as fp8_requested
from .gpus import GpuSpec
from .loading import (
    Batch,
    LossSpec,
    ModelSource,
    check_trainable,
    load_batch,
    load_model,
    output_structure,
    resolve_loss,
)
from .loading.nested import named_tensors
from .model_names import fingerprint, named_modules, unwrap_model
from .options import AuditOptions, _short_repr, resolve_steps
from .outputs import Staging, check_out_dir
from .planning.build_policy import build_policy
from .planning.rules import Plan
from .planning.verified import ChosenPlan, plan_and_verify
from .policy.schema import Policy
from .record import AuditRecord
from .record.codec import AUDIT_SCHEMA_ID, AUDIT_VERSION, to_json
from .record.json_text import dumps
from .run_setup import RunSetup, resolve_device, set_up
from .version import __version__

log = logging.getLogger(__name__)

__all__ = ["AuditOptions", "AuditResult", "AuditComputation", "Subject", "compute_audit", "load_subject",
           "resolve_device", "resolve_steps", "run_audit"]


@dataclass
class AuditResult:
    """One finished audit: its record (audit.json's content, typed: precision_audit/record/__init__.py), the policy, and
    what was written (``files``, empty until saved). ``audit`` is the record as audit.json's dict.

    The same record comes from :func:`run_audit` (already saved into ``--out``) and from
    ``precision_audit.audit(model, batch)`` (saved only when ``out=`` is given, or by :meth:`save`).
    In Jupyter it renders itself (:meth:`_repr_html_`: verdict, per-format table, plan, per-layer table).

    Example::

        result = precision_audit.audit(model, batch)
        print(result.summary())        # the terminal table
        result.policy                  # the per-layer Policy; precision_audit.apply_policy(model, result.policy)
                                       # trains under it
        result.save("audit")           # audit.json, policy.json, report.html and tb/, all or nothing
    """

    record: AuditRecord
    policy: Policy
    exit_code: int
    files: list[Path]
    analysis: Analysis
    plan: Plan
    #: The profiler traces of the timed steps, written under ``tb/`` by :meth:`save`.
    traces: dict[str, bytes] = field(default_factory=dict, repr=False)
    _html: str | None = field(default=None, repr=False, compare=False)

    @property
    def audit(self) -> dict[str, Any]:
        """audit.json's content (a new dict on every call, from :attr:`record`)."""
        return to_json(self.record)

    @property
    def html(self) -> str:
        """report.html's text (rendered once, on first use)."""
        return self.to_html()

    def to_html(self) -> str:
        """The full report page, as :meth:`save` writes it to report.html (self-contained, no network)."""
        if self._html is None:
            from .report.html import render_html  # jinja2 only when a report is wanted

            self._html = render_html(self.record, self.policy.to_dict())
        return self._html

    def _texts(self) -> tuple[str, str]:
        """audit.json's text and report.html's, from one ``to_json`` of the record (the page renders audit.json's
        content, record/codec.py ``as_stored``: building it once saves one conversion of the record)."""
        doc = to_json(self.record)
        text = dumps(doc, 1) + "\n"  # before the page reads the document
        if self._html is None:
            from .report.html import render_audit_json

            self._html = render_audit_json(doc, self.policy.to_dict())
        return text, self._html

    def summary(self) -> str:
        """The table the command line prints at the end of an audit, as text."""
        from .report.terminal import summary_text

        return summary_text(self.record)

    def save(self, out: str | os.PathLike[str]) -> list[Path]:
        """Write audit.json, policy.json, report.html and ``tb/`` into ``out`` (the same files as the command
        line), all or nothing (precision_audit/outputs.py); returns the paths and sets :attr:`files`.
        audit.json's ``options.out`` records ``out`` as given."""
        given = _out_path(out)
        check_out_dir(given, _OUT_FOLDERS)
        if self.record.options.out != str(given):
            self.record.options.out = str(given)
            self._html = None  # the report lists the options
        self.files = _write_outputs(_absolute(given), given, self.record, *self._texts(), self.policy, self.traces)
        return self.files

    def _repr_html_(self) -> str:
        """Jupyter's rich display: a self-contained fragment (no scripts, no network); see docs in README.md,
        "In a notebook"."""
        from .report.notebook import notebook_html

        return notebook_html(self.record, self.policy.to_dict(), self.files)

    def __repr__(self) -> str:
        return (f"<AuditResult {self.record.model.class_}: exit code {self.exit_code}; "
                f"{self.record.verdict.message}>")


Progress = Callable[[str], None]


class SubjectRun:
    """The model's forward on the batch (on the run's device) and its loss, resolved on the first output the
    same way for the audit and for ``precision-audit verify`` (precision_audit/loading/loss.py); records the output
    structure of every call."""

    def __init__(self, source: ModelSource, batch: Batch, device: str) -> None:
        self.source = source
        self.batch = batch.to(device)
        self.spec: LossSpec | None = None
        self.structures: list[str] = []
        self._pristine: list[tuple[torch.Tensor, torch.Tensor, int]] | None = None

    def forward(self, m: torch.nn.Module) -> Any:
        self._restore_batch()
        out = m(*self.batch.args, **self.batch.kwargs)
        self.structures.append(output_structure(out))
        return out

    def _restore_batch(self) -> None:
        """Every forward starts from the batch as loaded. A model that changes its input in place (``x.mul_(2)``,
        an in-place normalisation) would otherwise give each later pass another batch, and the formats'
        differences would be the batch's: the tensors are copied once, before the first forward, and put back
        where a version moved (the same tensor objects, so that calls on the batch are still recognised)."""
        both = (self.batch.args, self.batch.kwargs)
        tensors = list({id(t): t for _, t in named_tensors(both, "batch")}.values())
        if self._pristine is None:
            self._pristine = [(t, t.detach().clone(), t._version) for t in tensors]
            return
        for i, (t, kept, version) in enumerate(self._pristine):
            if t._version != version:
                with torch.no_grad():
                    t.copy_(kept)
                self._pristine[i] = (t, kept, t._version)

    def loss_of(self, out: Any) -> torch.Tensor:
        if self.spec is None:  # its trial call (a loss_fn's) builds no graph: the pass would count and hold it
            with torch.no_grad():
                self.spec = resolve_loss(self.source, out, self.batch)
        return self.spec(out, self.batch)

    def loss_facts(self) -> R.LossFacts | None:
        return None if self.spec is None else R.LossFacts(kind=str(self.spec.kind),
                                                           description=self.spec.description)

    def check_one_structure(self) -> None:
        if len(set(self.structures)) > 1:
            raise ModelRunError(
                "the model's forward returned different output structures on different calls, so its passes "
                "cannot be compared with each other",
                found=" vs ".join(sorted(set(self.structures))),
                hint="make the forward return the same structure on every call (look for branches on a call "
                     "counter, on self.training, or on autocast being enabled)")


@dataclass
class AuditComputation:
    """Everything the audit measured and decided, before anything is written."""

    record: AuditRecord
    policy: Policy
    exit_code: int
    analysis: Analysis
    plan: Plan
    capture: CaptureResult
    model: torch.nn.Module

    @property
    def audit(self) -> dict[str, Any]:
        """audit.json's content (from :attr:`record`)."""
        return to_json(self.record)

    @property
    def traces(self) -> dict[str, bytes]:
        return self.capture.traces


def run_audit(opts: AuditOptions, progress: Progress | None = None) -> AuditResult:
    """Run the whole audit and write report.html, policy.json, audit.json and ``tb/`` into ``opts.out``.

    The file-based entry point (the command line calls it): it loads MODEL and BATCH from files, then runs the
    same core as ``precision_audit.audit(model, batch)`` (precision_audit/api.py) and saves the result.
    ``--out`` and ``--batch`` are made absolute before the model file is imported, so a model that changes the
    working directory does not move them. The outputs are all-or-nothing (precision_audit/outputs.py): the
    folder keeps the previous audit untouched unless every new file was written. A model that calls
    ``sys.exit()`` raises :class:`ModelRunError` here instead of ending the caller's process.
    """
    say = progress or (lambda msg: None)
    given = opts
    check_out_dir(opts.out, _OUT_FOLDERS)
    opts = dataclasses.replace(opts, out=_absolute(opts.out),
                               batch=str(_absolute(Path(opts.batch))) if opts.batch is not None else None)
    try:
        c = compute_audit(opts, progress)
    except SystemExit as e:
        from .loading import model_exit_error

        raise model_exit_error(e, given.model) from e
    _record_paths_as_given(c.record, opts, given)
    say("writing report.html, policy.json and audit.json")
    result = result_of(c)
    result.files = _write_outputs(opts.out, given.out, c.record, *result._texts(), c.policy, c.traces)
    return result


def result_of(c: AuditComputation) -> AuditResult:
    """The record of a finished computation, not yet saved (``files`` empty)."""
    return AuditResult(record=c.record, policy=c.policy, exit_code=c.exit_code, files=[], analysis=c.analysis,
                       plan=c.plan, traces=dict(c.traces))


def _write_outputs(out: Path, given: Path, record: AuditRecord, audit_text: str, html: str, policy: Policy,
                   traces: dict[str, bytes]) -> list[Path]:
    """Stage every output in ``out`` (absolute) and move them into place together; the paths under ``given``.
    ``audit_text``: audit.json's text (``json.dumps(to_json(record), indent=1)``, record/json_text.py)."""
    from .report.tensorboard import EVENT_SUFFIX, write_scalars

    with Staging(out, _OUT_FOLDERS) as stage:
        stage.write("audit.json", audit_text)
        stage.write("policy.json", dumps(policy.to_dict(), 2) + "\n")
        stage.write("report.html", html)
        for name, data in traces.items():
            stage.write(f"tb/{name}", data)
        no_trace = _no_trace_text(record)
        if no_trace is not None:
            stage.write(f"tb/{NO_TRACE_FILE}", no_trace)
        stage.replace_old("tb", NO_TRACE_FILE)
        # an --out holds one audit's files: an earlier audit's profiler traces (tb/<format>/, named by
        # capture/timing.py's trace handler) go when these are committed, also for formats this run lacks
        stage.replace_old("tb", TRACE_PATTERN)
        events = write_scalars(record, stage.folder("tb/audit"))
        stage.replace_old("tb/audit", f"events.out.tfevents.*{EVENT_SUFFIX}")
        written = stage.commit()
    first = ["audit.json", "policy.json", "report.html"]
    names = first + sorted(p.relative_to(out).as_posix() for p in written
                           if p.relative_to(out).as_posix() not in first)
    event_name = f"tb/audit/{events.name}"
    names = [n for n in names if n != event_name] + [event_name]  # the event file last, as before
    return [given / n for n in names]


def _out_path(out: Any) -> Path:
    if isinstance(out, (str, os.PathLike)) and str(os.fspath(out)).strip():
        if "\0" in str(os.fspath(out)):  # no file system takes it; os.stat would raise ValueError at the end
            raise OptionError("out holds a NUL character", expected="a folder path without NUL characters",
                              found=_short_repr(os.fspath(out)))
        return Path(os.fspath(out))
    raise OptionError("out has the wrong type", expected="a folder path (str or pathlib.Path), not empty",
                      found=f"{type(out).__name__}: {_short_repr(out)}")


#: Folders the audit writes inside --out; a file of the same name is refused before the model runs.
_OUT_FOLDERS = ("tb", "tb/audit")
#: The profiler traces an audit writes under tb/<format>/ (torch's tensorboard_trace_handler with the worker
#: name "precision-audit-<format>", capture/timing.py); what a new audit replaces (docs/report.md, TensorBoard).
TRACE_PATTERN = "*/precision-audit-*.pt.trace.json"
#: In tb/ when the audit took no profiler trace: why, and how to get one (replaced by an audit with traces).
NO_TRACE_FILE = "NO_PROFILER_TRACE.txt"
_TRACE_NOTE = ("torch.profiler traces of the timed steps (Chrome trace JSON: open in Perfetto, or TensorBoard with "
               "the torch-tb-profiler plugin: tensorboard --logdir <out>/tb)")


def traces_note(taken: bool, steps: int, mode: str) -> str:
    """audit.json's ``traces.note``: what the trace files are, or why there are none although steps were timed
    (docs/gpu.md, "Timed steps"). Without timed steps (``--steps 0``) it keeps the description it always had."""
    if taken or not steps:
        return _TRACE_NOTE
    clock = "CUDA events" if mode == "cuda" else "the wall clock"
    return (f"no profiler trace taken: the timed steps were timed with {clock}, not under torch.profiler (its "
            "start-up takes seconds per run on a GPU); run with --trace (trace=True) for torch.profiler traces of "
            "them under tb/<format>/")


def _no_trace_text(record: AuditRecord) -> str | None:
    """tb/NO_PROFILER_TRACE.txt's text, when the audit timed steps without tracing them (the default on a GPU):
    tb/ then holds only the audit's scalars, and says why (with ``--steps 0`` nothing was timed to trace)."""
    if record.traces is None or record.traces.files or not record.options.steps:
        return None
    return f"No profiler trace in this audit: {record.traces.note}\n"


def _absolute(p: Path) -> Path:
    return Path(os.path.abspath(p.expanduser()))


def _record_paths_as_given(record: AuditRecord, used: AuditOptions, given: AuditOptions) -> None:
    """audit.json records --out and --batch as the user wrote them, not as made absolute for the run."""
    record.options.out = str(given.out)
    record.options.batch = given.batch
    if used.batch is not None and record.batch.source == used.batch:
        record.batch.source = given.batch


@dataclass(frozen=True)
class Subject:
    """What is audited: the model, where it came from (its ``loss_fn``), and the batch split for its forward.

    :func:`load_subject` builds it from MODEL and BATCH files; ``precision_audit.audit(model, batch)`` from live
    objects (precision_audit/api.py). The audit never changes ``model``: every pass runs on a copy
    (precision_audit/capture/__init__.py).
    """

    model: torch.nn.Module
    source: ModelSource
    batch: Batch


def load_subject(opts: AuditOptions) -> Subject:
    """Import MODEL, check it can be trained, and load BATCH (or the file's ``sample_batch()``) for it."""
    model, source = load_model(opts.model)
    model = unwrap_model(model)  # torch.compile's wrapper: its module, names as the runtime sees them
    check_trainable(model, source)
    return Subject(model, source, load_batch(opts.batch, model, source))


def compute_audit(opts: AuditOptions, progress: Progress | None = None, *,
                  subject: Subject | None = None,
                  session_factory: Callable[..., Any] | None = None) -> AuditComputation:
    """The audit without the outputs: load (unless ``subject`` is given), capture, analyse, plan; returns the
    record of it (audit.json's content) with the policy. ``session_factory`` replaces :class:`CaptureSession`
    (the distributed audit's, which reduces each pass across ranks: precision_audit/distributed/session.py)."""
    say = progress or (lambda msg: None)
    if subject is None:
        say("loading the model and the batch")
        subject = load_subject(opts)
    setup = set_up(opts, subject.model)
    on = setup.device if setup.gpu_index is None else f"{setup.device}:{setup.gpu_index}"
    say(f"target {setup.target.name} ({setup.target_reason}); {setup.mode} mode on {on}"
        f"{f' ({setup.kernels} kernels)' if setup.mode == 'emulated' else ''}; "
        f"formats: {', '.join(f.value for f in setup.formats) or 'none'}")
    # "cuda" is the current CUDA device for every tensor, event and statistic of the audit: the model's own
    with torch.cuda.device(setup.gpu_index) if setup.gpu_index is not None else contextlib.nullcontext():
        return _compute(opts, setup, subject, say, session_factory)


def _compute(opts: AuditOptions, setup: RunSetup, subject: Subject, say: Progress,
             session_factory: Callable[..., Any] | None) -> AuditComputation:
    """compute_audit's passes, analysis and plan, on the device ``setup`` resolved."""
    run = SubjectRun(subject.source, subject.batch, setup.device)
    config = CaptureConfig(formats=setup.formats, device=setup.device, mode=setup.mode, seed=opts.seed,
                           timed_steps=setup.steps, kernels=setup.kernels)
    model = subject.model
    with (session_factory or CaptureSession)(model, run.forward, run.loss_of, config, progress=say) as session:
        capture, noise = _capture(session, setup, run, say, opts.trace)
        say("analysing")
        perf = _performance(capture, setup, model, say)
        fp, n_modules = fingerprint(model)
        analysis, chosen = plan_and_verify(
            session, capture, noise, perf, setup.formats, setup.target.name, opts.budget, model, say,
            lambda plan, a: _policy(model, fp, n_modules, setup.target, plan, a))
        policy = _policy(model, fp, n_modules, setup.target, chosen.plan, analysis)
        capture = session.result()  # with what the passes at the second order added (their warnings)
        if noise is not None:  # its outputs are kept in the session's store, which closes with the session
            noise.outputs = None
    record = _record(opts, setup, subject, run, capture, noise, analysis, perf, chosen, fp, n_modules)
    if fp8_requested(opts.formats):  # issue 16: FP8 recipes per linear layer (precision_audit/fp8/, docs/fp8.md)
        record.fp8, fp8_plan = fp8_stage(model, run.forward, run.loss_of, setup.target, opts.budget,
                                         device=setup.device, seed=opts.seed, say=say,
                                         tokens_per_step=opts.fp8_tokens_per_step)
        policy.extra["fp8"] = fp8_plan.to_dict()
    return AuditComputation(record=record, policy=policy, exit_code=record.verdict.exit_code, analysis=analysis,
                            plan=chosen.plan, capture=capture, model=model)


def _policy(model: torch.nn.Module, fp: str, n_modules: int, target: GpuSpec, plan: Plan,
            analysis: Analysis) -> Policy:
    """The policy of ``plan``, its loss scale the one found for the modules the plan runs in FP16."""
    ls = analysis.loss_scale.for_plan(plan) if analysis.loss_scale else None
    return build_policy(model, fp, n_modules, target, plan, ls.recommended_scale if ls else None,
                        analysis.summaries.get(Format.TF32))


def _capture(session: CaptureSession, setup: RunSetup, run: SubjectRun, say: Progress, trace: bool = False
             ) -> tuple[CaptureResult, NoiseFloor | None]:
    """The FP32 reference, one pass per format (FP16 at the loss scale its gradients need), the noise floor
    and the timed steps (profiled too with ``trace``)."""
    formats = setup.formats
    say("FP32 reference pass (forward, backward, and each layer re-run alone per format)")
    session.reference_run()
    fp16_scale, overflow = 1.0, None
    if Format.FP16 in formats:
        overflow = next((r.name for r in session.layers.values() if r.name and
                         r.activation.fractions(Format.FP16)["overflow"] > 0), None)
        # from the gradients the uniform FP16 pass computes in FP16, not dL/dL (analysis/loss_scale.py)
        ls = recommend_fp16_loss_scale(session.layers.values(), overflow)
        fp16_scale = ls.recommended_scale or 1.0
    for f in formats:
        say(f"{f} pass" + (f" (loss scale {fp16_scale:g})" if f is Format.FP16 else ""))
        done = session.format_run(f, fp16_scale if f is Format.FP16 else 1.0)
        if f is Format.FP16:
            _back_off(session, done, overflow, say)
    run.check_one_structure()
    noise = None
    if formats:
        say("FP32 noise floor: the reference re-run forward at a second reduction order")
        noise = measure_noise_floor(session, formats, full=False)
    if setup.steps:
        say(f"timing {setup.steps} step(s) per format on {setup.device} (after one warm-up step)"
            + (", then profiling them for the traces" if trace else ""))
        session.timed_steps(setup.steps, traces=trace)
    return session.result(), noise


def _back_off(session: CaptureSession, done: RunRecord, forward_overflow: str | None, say: Progress) -> None:
    """An FP16 pass whose backward overflowed while its forward was finite ran at a scale too high for some
    gradient inside a module (which no module outputs, so the FP32 histograms that chose the scale cannot see
    it). torch.amp.GradScaler would skip that step and lower its scale; the audit finds the largest scale at which
    the pass's backward is finite (scales 2^e: one, two, four, ... doublings down, then bisection) and runs the
    pass at half of it, the one doubling of headroom the loss-scale rule keeps (analysis/loss_scale.py,
    ``BackwardOverflow``). When the backward is not finite even at the smallest scale, 2^-24, the overflow does not
    come from the scale: the pass runs again at the scale it started from, and nothing is capped. Not tried when
    the FP32 activations already overflow FP16 in the forward (every step is skipped then, whatever the scale).
    Only counts every rank agrees on decide (distributed audits). Each try is one more FP16 pass; every scale
    tried, with its non-finite parameter-gradient elements, goes into ``RunRecord.backoffs``."""
    def overflows(d: RunRecord) -> bool:
        return d.error is None and d.output_nonfinite == 0 and d.param_grads_nonfinite > 0

    def failed(d: RunRecord) -> bool:  # another failure (it raised, or its forward is not finite): reported as is
        return d.error is not None or d.output_nonfinite > 0

    if forward_overflow is not None or not overflows(done):
        return
    e_min = SCALE_EXPONENTS[0]
    start = round(math.log2(done.loss_scale))
    tried = [(done.loss_scale, done.param_grads_nonfinite)]

    say(f"fp16 pass: the backward overflowed at loss scale {done.loss_scale:g} with a finite forward "
        f"({done.param_grads_nonfinite} non-finite parameter-gradient elements): finding the largest scale at "
        "which it is finite, as GradScaler backs off")

    def run(e: int) -> RunRecord:
        s, n = tried[-1]
        say(f"fp16 pass again at loss scale 2^{e} (at {s:g}: "
            + ("finite)" if n == 0 else f"{n} non-finite parameter-gradient elements)"))
        session.forget_format_pass(Format.FP16)
        d = session.format_run(Format.FP16, math.ldexp(1.0, e))
        tried.append((d.loss_scale, d.param_grads_nonfinite))
        return d

    hi, lo, step = start, None, 1  # hi: overflowed; lo: finite
    while lo is None and hi > e_min:
        e = max(hi - step, e_min)
        done = run(e)
        if failed(done):
            done.backoffs = tried
            return
        hi, lo, step = (e, lo, step * 2) if overflows(done) else (hi, e, step)
    if lo is None:  # not finite at 2^-24 either: not the scale's doing
        if done.loss_scale != math.ldexp(1.0, start):
            done = run(start)
    else:
        while hi - lo > 1:
            mid = (hi + lo) // 2
            done = run(mid)
            if failed(done):
                done.backoffs = tried
                return
            hi, lo = (mid, lo) if overflows(done) else (hi, mid)
        final = max(lo - 1, e_min)  # one doubling of headroom below the largest finite scale
        if done.loss_scale != math.ldexp(1.0, final):
            done = run(final)
    done.backoffs = tried


def _performance(capture: CaptureResult, setup: RunSetup, model: torch.nn.Module, say: Progress) -> Performance:
    """Alignment, cost and memory on the target; on a GPU, the misaligned GEMMs timed as well."""
    shapes = {n: list(m.weight.shape) for n, m in named_modules(model)
              if isinstance(m, torch.nn.Embedding) and getattr(m, "weight", None) is not None}
    perf = performance(capture, setup.target, shapes, sum(p.numel() * p.element_size() for p in model.parameters()),
                       sum(p.numel() for p in model.parameters() if p.requires_grad), tied=tied_modules(model))
    if setup.mode == "cuda":
        say("timing misaligned GEMMs against their padded sizes on the GPU")
        measure_gemms_on_gpu(capture, perf, setup.target, setup.device, setup.formats)
    return perf


def _record(opts: AuditOptions, setup: RunSetup, subject: Subject, run: SubjectRun, capture: CaptureResult,
            noise: NoiseFloor | None, analysis: Analysis, perf: Performance, chosen: ChosenPlan, fp: str,
            n_modules: int) -> AuditRecord:
    """The audit's record, section by section in audit.json's order (docs/record.md)."""
    model, plan, target, label = subject.model, chosen.plan, setup.target, setup.time_label
    loss = run.loss_facts()
    assert loss is not None  # the reference pass resolved it, or the audit stopped
    alignment = rank_alignment({n: lp.alignment for n, lp in perf.layers.items()}, perf.step_time_s, target.name,
                               subject.batch.describe())
    noise_floor = assemble.section(R.NoiseFloor, noise.to_dict() if noise is not None else None)
    return AuditRecord(
        schema=AUDIT_SCHEMA_ID, version=AUDIT_VERSION, tool=R.Tool(name="precision-audit", version=__version__),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        mode=setup.mode, device=setup.device, hardware=setup.hardware.to_dict(),
        target={**target.to_dict(), "reason": setup.target_reason},
        formats=[f.value for f in setup.formats],
        formats_skipped=[R.SkippedFormat(format=s["format"], reason=s["reason"]) for s in setup.skipped],
        options=assemble.options(opts, setup.steps),
        model=assemble.model_facts(model, subject.source.label, fp, n_modules, capture.training, run.structures),
        batch=R.BatchFacts(source=subject.batch.source, tensors=subject.batch.describe()),
        loss=loss,
        emulation=capture.emulation,
        summary=assemble.summary(analysis, capture.step_times_s, label, perf.step_time_s, target.name),
        estimates=assemble.estimates(perf, target.name),
        memory=perf.memory,
        traces=R.Traces(dir="tb", files=sorted(f"tb/{k}" for k in capture.traces),
                        note=traces_note(bool(capture.traces), setup.steps, setup.mode)),
        alignment=assemble.section(R.AlignmentRanking, alignment),
        # the uniform FP16 pass's scale, and in "plan" the one re-derived for the modules the plan runs in FP16
        loss_scale=assemble.section(R.LossScale, analysis.loss_scale.to_dict(plan) if analysis.loss_scale else None),
        layers=[assemble.layer_report(L, plan, perf.layers.get(L.name), label) for L in analysis.layers],
        noise_floor=noise_floor,
        plan=assemble.plan_report(chosen, analysis),
        verdict=assemble.verdict(analysis, plan, setup.formats),
        warnings=assemble.run_warnings(capture, run.spec, run.structures, setup.mode) + capture.warnings
        + assemble.zero_gradient_warning(capture)
        + assemble.rnn_warning(model, setup.mode)
        + assemble.frozen_low_precision_warning(model)
        + assemble.noise_warning(noise_floor, opts.budget.to_dict())
        + assemble.unlowered_warning(capture)
        # FP32's own non-finite values: said once, and (analysis/findings.py) not held against any format
        + ([analysis.fp32_nonfinite.describe()] if analysis.fp32_nonfinite.any else []),
    )


# Called, this module is the live-object audit (precision_audit/__init__.py's _AuditModule hands the call to
# precision_audit/api.py, which is built on compute_audit above: this module never imports api.py).
sys.modules[__name__].__class__ = _AuditModule
