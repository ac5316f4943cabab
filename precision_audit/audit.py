"""The one straight-line pipeline: load -> hardware & target -> capture -> analysis -> plan -> outputs.

Only this module sees every stage. Example::

    from precision_audit import AuditOptions, run_audit
    result = run_audit(AuditOptions(model="sample_models/mlp/model.py", batch="sample_models/mlp/sample.pt"))
    result.exit_code, result.files

The module is also callable: ``precision_audit.audit(model, batch, ...)`` audits live objects through the same
:func:`compute_audit` (precision_audit/api.py; README.md, "From Python").
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
import math
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .analysis.alignment import rank_alignment, tied_modules
from .analysis.findings import Analysis, Budget, analyse
from .analysis.loss_scale import recommend_fp16_loss_scale
from .analysis.performance import performance
from .capture.compiled import KERNEL_CHOICES
from .capture.compiled import resolve as resolve_kernels
from .capture.noise import measure_noise_floor
from .capture.runner import CaptureConfig, CaptureSession
from .errors import SEED_MAX, SEED_MIN, AuditError, ModelRunError, OptionError
from .formats import CAPTURE_FORMATS, LOW_PRECISION_DTYPES, Format, parse_formats
from .gpus import GpuSpec, resolve_target
from .hardware import HardwareInfo, default_target, detect
from .loading import (Batch, LossSpec, ModelSource, check_trainable, load_batch, load_model, output_structure,
                      resolve_loss)
from .outputs import Staging, check_out_dir
from .planning.rules import Plan, make_planned
from .policy.schema import LossScaling, ModuleOverride, Policy, fingerprint, model_layout
from .report.audit_json import AUDIT_SCHEMA_ID, AUDIT_VERSION, clean, layer_dict, summary_dict

log = logging.getLogger(__name__)


#: The seeds torch.manual_seed accepts (negative ones are mapped onto the unsigned range).
_FORMAT_VALUES = frozenset(f.value for f in Format)


def _short_repr(value: Any, limit: int = 80) -> str:
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__ must not turn an OptionError into another error
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True)
class AuditOptions:
    """Everything the command line can set. ``formats=None`` means every capturable format the target supports.

    ``out`` may be a ``str`` or any path-like (stored as a ``Path``), ``model``/``batch`` a path-like too, and
    ``formats`` a list or a ``"fp16,bf16"`` string; a field of another type, or a ``seed`` outside torch's range
    (-2**63 to 2**64 - 1), raises :class:`OptionError` naming the field.
    """

    model: str
    batch: str | None = None
    out: Path = Path("audit")
    target: str | None = None
    formats: tuple[Format, ...] | None = None
    device: str = "auto"
    emulate: bool = False
    steps: int | None = None  # None: 1 in cuda mode, 0 in emulated mode (see resolve_steps)
    seed: int = 0
    budget: Budget = field(default_factory=Budget)
    kernels: str = "auto"

    def __post_init__(self) -> None:
        self._coerce_and_check_types()
        if self.device not in ("auto", "cuda", "cpu"):
            raise OptionError(f"unknown --device {self.device!r}", choices=("auto", "cuda", "cpu"))
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 0):
            raise OptionError("--steps must be a whole number >= 0", found=repr(self.steps))
        if self.kernels not in KERNEL_CHOICES:
            raise OptionError(f"unknown --kernels {self.kernels!r}", choices=KERNEL_CHOICES)

    def _coerce_and_check_types(self) -> None:
        """Paths may be given as ``str`` or ``os.PathLike`` (``out`` becomes a ``Path``, ``model`` and ``batch``
        strings), ``formats`` as a list or a ``"fp16,bf16"`` string; any other type raises :class:`OptionError`
        naming the field, rather than failing later inside the audit."""
        def setf(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)  # frozen dataclass

        def wrong(name: str, expected: str) -> OptionError:
            value = getattr(self, name)
            return OptionError(f"AuditOptions.{name} has the wrong type", expected=expected,
                               found=f"{type(value).__name__}: {_short_repr(value)}")

        if isinstance(self.model, os.PathLike):
            setf("model", os.fspath(self.model))
        if not isinstance(self.model, str):
            raise wrong("model", "a str: path/to/model.py[:name] or package.module:name")
        if isinstance(self.batch, os.PathLike):
            setf("batch", os.fspath(self.batch))
        if self.batch is not None and not isinstance(self.batch, str):
            raise wrong("batch", "None, or the path of a torch.save file (str or pathlib.Path)")
        if isinstance(self.out, str) and not self.out.strip():
            raise wrong("out", "a folder path (str or pathlib.Path), not empty")
        if isinstance(self.out, (str, os.PathLike)) and not isinstance(self.out, Path):
            setf("out", Path(os.fspath(self.out)))
        if not isinstance(self.out, Path):
            raise wrong("out", "a folder path (str or pathlib.Path), not empty")
        if self.target is not None and not isinstance(self.target, str):
            raise wrong("target", "None, or a GPU name or alias (str), e.g. 'h100'")
        if isinstance(self.target, str) and not self.target.strip():
            # an empty name must not silently mean "the default target" (the CLI refuses --target "" too)
            raise OptionError("target is empty", expected="a GPU name or alias, e.g. 'h100', or None for the default",
                              found=repr(self.target), hint="`precision-audit targets` lists the names")
        if isinstance(self.formats, str):
            setf("formats", parse_formats(self.formats))
        elif isinstance(self.formats, (list, tuple)):
            setf("formats", tuple(Format(f) if isinstance(f, str) and f in _FORMAT_VALUES else f
                                  for f in self.formats))
        if self.formats is not None and not (isinstance(self.formats, tuple)
                                             and all(isinstance(f, Format) for f in self.formats)):
            raise wrong("formats", "None, or a tuple of Format (or of format names such as 'fp16')")
        for name in ("device", "kernels"):
            if not isinstance(getattr(self, name), str):
                raise wrong(name, "a str")
        if not isinstance(self.emulate, bool):
            raise wrong("emulate", "True or False")
        if isinstance(self.steps, bool):
            raise wrong("steps", "None, or a whole number >= 0 (int)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise wrong("seed", f"a whole number (int) in [{SEED_MIN}, {SEED_MAX}]")
        if not SEED_MIN <= self.seed <= SEED_MAX:
            raise OptionError("--seed is outside the range torch's random generators accept",
                              expected=f"a whole number from {SEED_MIN} to {SEED_MAX} (-2**63 to 2**64 - 1)",
                              found=str(self.seed), hint="pick a smaller seed, e.g. --seed 0")
        if not isinstance(self.budget, Budget):
            raise wrong("budget", "a precision_audit.analysis.findings.Budget")


@dataclass
class AuditResult:
    """One finished audit: audit.json's content, the policy, and what was written (``files``, empty until saved).

    The same record comes from :func:`run_audit` (already saved into ``--out``) and from
    ``precision_audit.audit(model, batch)`` (saved only when ``out=`` is given, or by :meth:`save`).
    In Jupyter it renders itself (:meth:`_repr_html_`: verdict, per-format table, plan, per-layer table).

    Example::

        result = precision_audit.audit(model, batch)
        print(result.summary())        # the terminal table
        result.policy                  # the per-layer Policy (result.policy.apply(model) to train under it)
        result.save("audit")           # audit.json, policy.json, report.html and tb/, all or nothing
    """

    audit: dict[str, Any]
    policy: Policy
    exit_code: int
    files: list[Path]
    analysis: Analysis
    plan: Plan
    #: The profiler traces of the timed steps, written under ``tb/`` by :meth:`save`.
    traces: dict[str, bytes] = field(default_factory=dict, repr=False)
    _html: str | None = field(default=None, repr=False, compare=False)

    @property
    def html(self) -> str:
        """report.html's text (rendered once, on first use)."""
        return self.to_html()

    def to_html(self) -> str:
        """The full report page, as :meth:`save` writes it to report.html (self-contained, no network)."""
        if self._html is None:
            from .report.html import render_html  # jinja2 only when a report is wanted

            self._html = render_html(self.audit, self.policy.to_dict())
        return self._html

    def summary(self) -> str:
        """The table the command line prints at the end of an audit, as text."""
        from .report.terminal import summary_text

        return summary_text(self.audit)

    def save(self, out: str | os.PathLike[str]) -> list[Path]:
        """Write audit.json, policy.json, report.html and ``tb/`` into ``out`` (the same files as the command
        line), all or nothing (precision_audit/outputs.py); returns the paths and sets :attr:`files`.
        audit.json's ``options.out`` records ``out`` as given."""
        given = _out_path(out)
        check_out_dir(given, _OUT_FOLDERS)
        options = self.audit.get("options")
        if isinstance(options, dict) and options.get("out") != str(given):
            options["out"] = str(given)
            self._html = None  # the report lists the options
        self.files = _write_outputs(_absolute(given), given, self.audit, self.policy, self.to_html(), self.traces)
        return self.files

    def _repr_html_(self) -> str:
        """Jupyter's rich display: a self-contained fragment (no scripts, no network); see docs in README.md,
        "In a notebook"."""
        from .report.notebook import notebook_html

        return notebook_html(self.audit, self.policy.to_dict(), self.files)

    def __repr__(self) -> str:
        v = self.audit.get("verdict", {})
        return (f"<AuditResult {self.audit.get('model', {}).get('class', '?')}: exit code {self.exit_code}; "
                f"{v.get('message', '')}>")


Progress = Callable[[str], None]


def _resolve_device(opts: AuditOptions, hw: HardwareInfo) -> tuple[str, str]:
    if opts.device == "cuda" and not hw.cuda_available:
        raise OptionError("--device cuda was asked for, but torch sees no CUDA GPU",
                          found=f"torch {hw.torch_version}, CUDA build: {hw.cuda_version or 'no'}",
                          hint="use --device cpu (numerics are emulated faithfully), or install a CUDA build of torch")
    if opts.emulate:
        if opts.device == "cuda":
            raise OptionError("--emulate runs the emulation on the CPU; it cannot be combined with --device cuda",
                              hint="drop one of the two: --device cuda measures real kernels, --emulate emulates them")
        return "cpu", "emulated"
    device = "cuda" if (opts.device == "cuda" or (opts.device == "auto" and hw.cuda_available)) else "cpu"
    return device, ("cuda" if device == "cuda" else "emulated")


def resolve_steps(steps: int | None, mode: str) -> int:
    """The timed steps per format: as asked, else 1 in cuda mode and 0 in emulated mode, where the CPU's timing
    of an emulated step says nothing about the target GPU (README.md, ``--steps``)."""
    if steps is not None:
        return steps
    return 1 if mode == "cuda" else 0


def _select_formats(opts: AuditOptions, target: GpuSpec) -> tuple[tuple[Format, ...], list[dict[str, str]]]:
    requested = opts.formats or (Format.FP16, Format.BF16)
    chosen, skipped = [], []
    for f in requested:
        if f is Format.FP32:
            continue  # the reference always runs
        if f not in CAPTURE_FORMATS:
            skipped.append({"format": f.value, "reason": f"not measured: {f} runs are not built yet in this version"})
        elif not target.supports(f.value):
            skipped.append({"format": f.value,
                            "reason": f"not a candidate: {target.name} (compute capability {target.cc_string}) "
                                      f"has no {f} Tensor Cores"})
        else:
            chosen.append(f)
    if not chosen and opts.formats:
        raise OptionError(
            f"none of the formats asked for can be audited on {target.name}",
            found=", ".join(f"{s['format']} ({s['reason']})" for s in skipped),
            choices=[f.value for f in CAPTURE_FORMATS if target.supports(f.value)],
            hint="drop --formats, or pick another --target",
        )
    return tuple(chosen), skipped


@dataclass
class AuditComputation:
    """Everything the audit measured and decided, before anything is written."""

    audit: dict[str, Any]
    policy: Policy
    exit_code: int
    analysis: Analysis
    plan: Plan
    capture: Any
    model: torch.nn.Module


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
    _record_paths_as_given(c.audit, opts, given)
    say("writing report.html, policy.json and audit.json")
    result = result_of(c)
    result.files = _write_outputs(opts.out, given.out, c.audit, c.policy, result.to_html(), c.capture.traces)
    return result


def result_of(c: AuditComputation) -> AuditResult:
    """The record of a finished computation, not yet saved (``files`` empty)."""
    return AuditResult(audit=c.audit, policy=c.policy, exit_code=c.exit_code, files=[], analysis=c.analysis,
                       plan=c.plan, traces=dict(c.capture.traces))


def _write_outputs(out: Path, given: Path, audit: dict[str, Any], policy: Policy, html: str,
                   traces: dict[str, bytes]) -> list[Path]:
    """Stage every output in ``out`` (absolute) and move them into place together; the paths under ``given``."""
    from .report.tensorboard import EVENT_SUFFIX, write_scalars  # tensorboard only when writing

    with Staging(out, _OUT_FOLDERS) as stage:
        stage.write("audit.json", json.dumps(audit, indent=1, allow_nan=False) + "\n")
        stage.write("policy.json", json.dumps(policy.to_dict(), indent=2, allow_nan=False) + "\n")
        stage.write("report.html", html)
        for name, data in traces.items():
            stage.write(f"tb/{name}", data)
        events = write_scalars(audit, stage.folder("tb/audit"))
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
        return Path(os.fspath(out))
    raise OptionError("out has the wrong type", expected="a folder path (str or pathlib.Path), not empty",
                      found=f"{type(out).__name__}: {_short_repr(out)}")


#: Folders the audit writes inside --out; a file of the same name is refused before the model runs.
_OUT_FOLDERS = ("tb", "tb/audit")


def _absolute(p: Path) -> Path:
    return Path(os.path.abspath(p.expanduser()))


def _record_paths_as_given(audit: dict[str, Any], used: AuditOptions, given: AuditOptions) -> None:
    """audit.json records --out and --batch as the user wrote them, not as made absolute for the run."""
    options = audit.get("options")
    if isinstance(options, dict):
        options["out"] = str(given.out)
        options["batch"] = given.batch
    batch = audit.get("batch")
    if isinstance(batch, dict) and used.batch is not None and batch.get("source") == used.batch:
        batch["source"] = given.batch


@dataclass(frozen=True)
class Subject:
    """What is audited: the model, where it came from (its ``loss_fn``), and the batch split for its forward.

    :func:`load_subject` builds it from MODEL and BATCH files; ``precision_audit.audit(model, batch)`` from live
    objects (precision_audit/api.py). The audit never changes ``model``: every pass runs on a copy
    (precision_audit/capture/runner.py).
    """

    model: torch.nn.Module
    source: ModelSource
    batch: Batch


def load_subject(opts: AuditOptions) -> Subject:
    """Import MODEL, check it can be trained, and load BATCH (or the file's ``sample_batch()``) for it."""
    model, source = load_model(opts.model)
    check_trainable(model, source)
    return Subject(model, source, load_batch(opts.batch, model, source))


def compute_audit(opts: AuditOptions, progress: Progress | None = None, *,
                  subject: Subject | None = None, session_factory: Callable[..., Any] | None = None) -> AuditComputation:
    """The audit without the outputs: load (unless ``subject`` is given), capture, analyse, plan; returns
    audit.json's content. ``session_factory`` replaces :class:`CaptureSession` (the distributed audit's, which
    reduces each pass across ranks: precision_audit/distributed/session.py)."""
    say = progress or (lambda msg: None)

    if subject is None:
        say("loading the model and the batch")
        subject = load_subject(opts)
    model, source, batch = subject.model, subject.source, subject.batch

    hw = detect()
    if opts.target:
        target, target_reason = resolve_target(opts.target), "chosen with --target"
    else:
        target, target_reason = default_target(hw)
    formats, skipped = _select_formats(opts, target)
    device, mode = _resolve_device(opts, hw)
    steps = resolve_steps(opts.steps, mode)
    kernels = resolve_kernels(opts.kernels) if mode == "emulated" else "python"
    say(f"target {target.name} ({target_reason}); {mode} mode on {device}"
        f"{f' ({kernels} kernels)' if mode == 'emulated' else ''}; formats: {', '.join(f.value for f in formats) or 'none'}")

    run_batch = batch.to(device)
    loss_box: dict[str, LossSpec] = {}
    structures: list[str] = []

    def forward(m: torch.nn.Module) -> Any:
        out = m(*run_batch.args, **run_batch.kwargs)
        structures.append(output_structure(out))
        return out

    def loss_of(out: Any) -> torch.Tensor:
        if "spec" not in loss_box:
            loss_box["spec"] = resolve_loss(source, out, run_batch)
        return loss_box["spec"](out, run_batch)

    config = CaptureConfig(formats=formats, device=device, mode=mode, seed=opts.seed, timed_steps=steps,
                           kernels=kernels)
    with (session_factory or CaptureSession)(model, forward, loss_of, config, progress=say) as session:
        say("FP32 reference pass (forward, backward, and each layer re-run alone per format)")
        session.reference_run()
        fp16_scale = 1.0
        if Format.FP16 in formats:
            overflow = next((r.name for r in session.layers.values() if r.name and
                             r.activation.fractions(Format.FP16)["overflow"] > 0), None)
            # from the gradients the uniform FP16 pass computes in FP16, not dL/dL (analysis/loss_scale.py)
            ls = recommend_fp16_loss_scale(session.layers.values(), overflow)
            fp16_scale = ls.recommended_scale or 1.0
        for f in formats:
            say(f"{f} pass" + (f" (loss scale {fp16_scale:g})" if f is Format.FP16 else ""))
            session.format_run(f, fp16_scale if f is Format.FP16 else 1.0)
        if len(set(structures)) > 1:
            raise ModelRunError(
                "the model's forward returned different output structures on different calls, so its passes "
                "cannot be compared with each other",
                found=" vs ".join(sorted(set(structures))),
                hint="make the forward return the same structure on every call (look for branches on a call "
                     "counter, on self.training, or on autocast being enabled)")
        noise = None
        if formats:
            say("FP32 noise floor: the reference and each format re-run forward at a second reduction order")
            noise = measure_noise_floor(session, formats)
        if steps:
            say(f"profiling {steps} timed step(s) per format on {device} (after one warm-up step)")
            session.timed_steps(steps)
        capture = session.result()

        say("analysing")
        analysis = analyse(capture, opts.budget, noise)
        shapes = {n: list(m.weight.shape) for n, m in model.named_modules()
                  if isinstance(m, torch.nn.Embedding) and getattr(m, "weight", None) is not None}
        perf = performance(capture, target, shapes, sum(p.numel() * p.element_size() for p in model.parameters()),
                           sum(p.numel() for p in model.parameters() if p.requires_grad), tied=tied_modules(model))
        if mode == "cuda":
            say("timing misaligned GEMMs against their padded sizes on the GPU")
            _measure_gemms_on_gpu(capture, perf, target, device, formats)
        alignment = rank_alignment({n: lp.alignment for n, lp in perf.layers.items()}, perf.step_time_s,
                                   target.name, batch.describe())
        mixed, planner_result = make_planned(analysis, capture, perf, formats, target.name, model)
        fp, n_modules = fingerprint(model)
        chosen, candidates = _choose_plan(session, model, fp, n_modules, target, analysis, perf, formats, mixed,
                                          planner_result, noise, say)
        plan = chosen.plan
        policy = _policy(model, fp, n_modules, target, plan, analysis)
    safe = [f.value for f, s in analysis.summaries.items() if s.safe]
    exit_code = 0 if (safe or not formats) else 1

    time_label = (f"{hw.gpus[0].name} (cuda)" if mode == "cuda" and hw.gpus else
                  f"this machine's {device.upper()} ({'emulated numerics; CPU time, not a GPU estimate' if mode == 'emulated' else 'cuda'})")
    audit = {
        "schema": AUDIT_SCHEMA_ID,
        "version": AUDIT_VERSION,
        "tool": {"name": "precision-audit", "version": __version__},
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "mode": mode,
        "device": device,
        "hardware": hw.to_dict(),
        "target": {**target.to_dict(), "reason": target_reason},
        "formats": [f.value for f in formats],
        "formats_skipped": skipped,
        "options": {"model": opts.model, "batch": opts.batch, "out": str(opts.out), "target": opts.target,
                    "formats": [f.value for f in opts.formats] if opts.formats else None, "device": opts.device,
                    "emulate": opts.emulate, "steps": steps, "seed": opts.seed, "budget": opts.budget.to_dict(),
                    "kernels": opts.kernels},
        "model": {
            "class": type(model).__name__,
            "source": source.label,
            "parameters": sum(p.numel() for p in model.parameters()),
            "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "fingerprint": fp,
            "modules": n_modules,
            "training": capture.training,
            "mode_note": ("audited in train mode (as the model was given): dropout is active with the same masks "
                          "in every format, BatchNorm uses batch statistics" if capture.training else
                          "audited in eval mode (as the model was given): dropout off, BatchNorm uses running statistics"),
            "output_structure": structures[0] if structures else None,
        },
        "batch": {"source": batch.source, "tensors": batch.describe()},
        "loss": {"kind": str(loss_box["spec"].kind), "description": loss_box["spec"].description},
        "emulation": capture.emulation,
        "summary": summary_dict(analysis, capture.step_times_s, time_label, perf.step_time_s, target.name),
        "estimates": {
            "target": target.name,
            "kind": "estimate",
            "step_time_s": perf.step_time_s,
            "speedup_vs_fp32": perf.speedup_vs_fp32,
            "assumptions": list(perf.assumptions),
        },
        "memory": perf.memory,
        "traces": {"dir": "tb", "files": sorted(f"tb/{k}" for k in capture.traces),
                   "note": "torch.profiler traces of the timed steps (Chrome trace JSON: open in Perfetto, or "
                           "TensorBoard with the torch-tb-profiler plugin: tensorboard --logdir <out>/tb)"},
        # the uniform FP16 pass's scale, and in "plan" the one re-derived for the modules the plan runs in FP16
        "alignment": alignment,
        "loss_scale": analysis.loss_scale.to_dict(plan) if analysis.loss_scale else None,
        "layers": [layer_dict(L, plan, perf.layers.get(L.name), time_label) for L in analysis.layers],
        "noise_floor": noise.to_dict() if noise is not None else None,
        "plan": _plan_dict(plan, chosen, candidates, planner_result, analysis),
        "verdict": {"exit_code": exit_code, "safe_formats": safe,
                    "message": _verdict_message(analysis, plan, safe, formats)},
        "warnings": _warnings(capture, loss_box["spec"], mode, structures) + capture.warnings
        + _rnn_warning(model, mode)
        # FP32's own non-finite values: said once, and (analysis/findings.py) not held against any format
        + ([analysis.fp32_nonfinite.describe()] if analysis.fp32_nonfinite.any else []),
    }
    return AuditComputation(audit=clean(audit), policy=policy, exit_code=exit_code, analysis=analysis, plan=plan,
                            capture=capture, model=model)


def _policy(model, fp: str, n_modules: int, target: GpuSpec, plan: Plan, analysis: Analysis) -> Policy:
    uses_fp16 = plan.default_format is Format.FP16 or any(o.format is Format.FP16 for o in plan.overrides.values())
    ls = analysis.loss_scale.for_plan(plan) if analysis.loss_scale else None
    init = ls.recommended_scale if (ls and ls.recommended_scale) else 65536.0
    error_pins = any("local error" in o.reason for o in plan.overrides.values())
    tf32 = target.supports("tf32") and not error_pins
    return Policy(
        model_class=type(model).__name__,
        model_fingerprint=fp,
        model_modules=n_modules,
        target_name=target.name,
        target_compute_capability=tuple(target.compute_capability),
        target_key=target.key,
        default_format=plan.default_format.value,
        modules={k: ModuleOverride(v.format.value, v.reason) for k, v in plan.overrides.items()},
        loss_scaling=LossScaling(enabled=uses_fp16, init_scale=init),
        tf32_matmul=tf32,
        tf32_cudnn=tf32,
        tool_version=__version__,
        model_layout=model_layout(model),
    )


def plan_counts(plan: Plan) -> str:
    """The plan's overrides counted by format, from the plan itself: "5 in fp32, 7 in bf16" ("" when none)."""
    by: dict[str, int] = {}
    for o in plan.overrides.values():
        by[o.format.value] = by.get(o.format.value, 0) + 1
    return ", ".join(f"{n} in {f}" for f, n in sorted(by.items(), key=lambda x: (-x[1], x[0])))


def _verdict_message(analysis: Analysis, plan: Plan, safe: list[str], formats: tuple[Format, ...]) -> str:
    if not formats:
        return "no low-precision format was audited"
    counts = plan_counts(plan)
    pins = (f"; {len(plan.overrides)} module(s) overridden: {counts}" if plan.overrides else
            "; no overrides")
    if safe:
        return f"recommended: {plan.default_format} by default{pins}. Safe as is: {', '.join(safe)}"
    return (f"unsafe in every audited format as is ({', '.join(f.value for f in formats)}); "
            f"the policy runs {plan.default_format} by default{pins}")


def _choose_plan(session, model, fp, n_modules, target, analysis, perf, formats, mixed, planner_result, noise, say):
    """The mixed plan against the uniform formats (planning/select.py), verified at both reduction orders."""
    from .capture.noise import plan_forward
    from .planning.select import choose

    ref = analysis.reference_loss

    def make_policy(p: Plan) -> Policy:
        return _policy(model, fp, n_modules, target, p, analysis)

    def verify(pol, default):
        run = session.verify_plan(pol, default)
        lc = ((abs(run.loss - ref) / abs(ref) if ref else abs(run.loss))
              if run.loss is not None and math.isfinite(run.loss) else math.inf)
        lcs, oes = [lc], [run.output.rel_l2 if run.output else math.inf]
        error = run.error
        if noise is not None:
            alt = plan_forward(session, noise, pol, default)
            a = noise.rel_change(alt.loss)
            lcs.append(a if a is not None else math.inf)
            oes.append(alt.output_rel_error if alt.output_rel_error is not None else math.inf)
            error = error or alt.error
        return lcs, oes, error, run.loss

    def impact_of(name: str, fmt: Format) -> float:
        d = planner_result.decisions.get(name) if planner_result else None
        return (d.impact.get(fmt) or 0.0) if d is not None else 0.0

    return choose(analysis, perf, formats, mixed, planner_result, verify, make_policy, impact_of, say)


def _plan_dict(plan: Plan, chosen, candidates, planner_result, analysis: Analysis) -> dict[str, Any]:
    from .planning.select import first_order_rel, predicted_rel, prediction_note

    ref = analysis.reference_loss
    predicted = predicted_rel(plan, planner_result, ref) if plan.default_format is not Format.FP32 or plan.overrides \
        else 0.0
    first_order = first_order_rel(plan, planner_result, ref) if plan.default_format is not Format.FP32 \
        or plan.overrides else 0.0
    verified = chosen.loss_rel_change
    floor = analysis.noise.loss_rel if analysis.noise is not None and math.isfinite(analysis.noise.loss_rel) else 0.0
    uniform = chosen.label.startswith("uniform")
    return {
        "source": plan.source,
        "chosen": chosen.label,
        "candidates": [c.to_dict(c is chosen) for c in candidates],
        "predicted_loss_change": predicted * abs(ref) if predicted is not None else None,
        "predicted_loss_rel_change": predicted,
        "first_order_loss_rel_change": first_order,
        "prediction": prediction_note(predicted, verified, floor),
        "calibration": planner_result.calibration_info if planner_result else {},
        "loss_budget": analysis.budget.max_loss_rel_change * abs(ref) if ref else analysis.budget.max_loss_rel_change,
        "promotions": planner_result.promotions if planner_result and not uniform else [],
        "estimated_step_time_s": chosen.estimated_step_time_s,
        "verification": {
            "passes": chosen.passes,
            "loss": chosen.loss,
            "loss_rel_change": verified,
            "loss_rel_change_range": list(chosen.loss_rel_change_range) if chosen.loss_rel_change_range else None,
            "output_rel_error": chosen.output_rel_error,
            "within_budget": chosen.within_budget,
            "repairs": list(chosen.repairs),
            "error": chosen.error,
            "source": (f"the audit's own all-{plan.default_format} pass{'es' if analysis.noise else ''} (no extra "
                       "pass: this plan is that format, uniform)" if uniform else
                       "forward passes with the policy applied, one per reduction order"),
        },
        "default_format": plan.default_format.value,
        "default_reason": plan.default_reason,
        "overrides": {k: {"format": v.format.value, "reason": v.reason} for k, v in plan.overrides.items()},
        "override_counts": plan_counts(plan) or "none",
    }


def _measure_gemms_on_gpu(capture, perf, target: GpuSpec, device: str, formats: tuple[Format, ...]) -> None:
    """Attach measured times to alignment findings: each misaligned GEMM as is and padded (CUDA only)."""
    from .capture.gemm_bench import measure_gemms

    measure_gemms(capture, perf, target, device, formats)


def _rnn_warning(model: torch.nn.Module, mode: str) -> list[str]:
    rnns = [n for n, m in model.named_modules() if isinstance(m, (torch.nn.LSTM, torch.nn.GRU))]
    if mode != "emulated" or not rnns:
        return []
    return [f"{', '.join(rnns[:5])}: nn.LSTM/nn.GRU run in fp16 on CUDA through cuDNN's own autocast wrapper, "
            "which the emulation does not reproduce (they stay fp32 here); audit on a GPU for their numerics"]


def _warnings(capture, spec: LossSpec, mode: str, structures: list[str]) -> list[str]:
    w = []
    if mode == "emulated":
        w.append("emulated mode: CUDA autocast's op policies and Tensor Core rounding are computed on "
                 f"{capture.device}; known gaps: " + "; ".join(capture.emulation["known_gaps"] if capture.emulation else []))
        if capture.emulation and capture.emulation["unknown_cuda_autocast_ops"]:
            w.append("ops CUDA autocast lowers that the emulation table lacks (emulated as unlisted): "
                     + ", ".join(capture.emulation["unknown_cuda_autocast_ops"]))
    if str(spec.kind) in ("cross_entropy", "mse"):
        w.append(f"loss inferred: {spec.description}")
    elif str(spec.kind) == "surrogate":
        w.append(f"no loss defined: {spec.description}; gradient figures describe this surrogate, "
                 "define loss_fn(output, batch) in the model file for real ones")
    if len(set(structures)) > 1:
        w.append("the model's forward returned different output structures on different calls: "
                 + " vs ".join(sorted(set(structures))))
    for f, run in capture.runs.items():
        if run.error:
            w.append(f"{f} pass not measured: {run.error}")
    return w


class _AuditModule(types.ModuleType):
    """``precision_audit.audit`` is this module and, called, the live-object audit: ``precision_audit.audit(model,
    batch, ...)`` runs :func:`precision_audit.api.audit`. (A plain function of that name in the package would be
    replaced by this module as soon as it is imported, and ``import precision_audit.audit`` must keep working.)"""

    def __call__(self, model: Any, batch: Any, **kwargs: Any) -> AuditResult:
        from .api import audit

        return audit(model, batch, **kwargs)


sys.modules[__name__].__class__ = _AuditModule
