"""What an audit is asked to do (:class:`AuditOptions`), and how the request meets this machine and the target
(:class:`RunSetup`): the device and mode, the timed steps, the formats audited and those skipped (with why).

audit.py resolves them once at the start of an audit (:func:`set_up`); ``precision-audit verify`` resolves its
device here too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .analysis.findings import Budget
from .capture.compiled import KERNEL_CHOICES
from .capture.compiled import resolve as resolve_kernels
from .capture.model_state import model_cuda_index
from .errors import SEED_MAX, SEED_MIN, OptionError
from .formats import CAPTURE_FORMATS, DEFAULT_FORMATS, Format, parse_formats
from .fp8.audit import SKIP_REASON as FP8_SKIP_REASON
from .fp8.audit import requested as fp8_requested
from .gpus import GpuSpec, resolve_target
from .hardware import HardwareInfo, default_target, detect

#: Format names AuditOptions.formats accepts as strings.
_FORMAT_VALUES = frozenset(f.value for f in Format)


def _short_repr(value: Any, limit: int = 80) -> str:
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__ must not turn an OptionError into another error
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


#: The most rows per training step ``--tokens-per-step`` takes: 2**40, a million times the largest steps trained
#: today, and far inside a float's range (10**400 rows raised OverflowError in the FP8 cost model: exit 3).
MAX_TOKENS_PER_STEP = 2 ** 40


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
    #: rows per training step each linear is priced at in the FP8 plan; None: the audited batch's (docs/fp8.md)
    fp8_tokens_per_step: int | None = None
    #: also run the timed steps under torch.profiler and keep its traces for tb/ (docs/gpu.md, "Timed steps")
    trace: bool = False

    def __post_init__(self) -> None:
        self._coerce_and_check_types()
        t = self.fp8_tokens_per_step
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= MAX_TOKENS_PER_STEP):
            raise OptionError(f"--tokens-per-step must be a whole number from 1 to {MAX_TOKENS_PER_STEP} (2**40)",
                              found=_short_repr(t),
                              hint="the rows (batch x sequence) one training step feeds each linear, e.g. 65536")
        if t is not None and not fp8_requested(self.formats):
            raise OptionError("--tokens-per-step prices the FP8 plan, and no FP8 format is audited",
                              found=f"--formats {','.join(f.value for f in self.formats or ())}",
                              hint="add fp8_e4m3 to --formats, or leave --tokens-per-step out")
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
        if not isinstance(self.trace, bool):
            raise wrong("trace", "True or False")
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


def resolve_device(device: str, emulate: bool, hw: HardwareInfo) -> tuple[str, str]:
    """(torch device, mode) for ``--device`` and ``--emulate`` on this machine: ``cuda`` measures real kernels,
    ``emulated`` computes CUDA autocast's numerics on the CPU (README.md, ``--device``). The audit and
    ``precision-audit verify`` resolve it the same way."""
    if device == "cuda" and not hw.cuda_available:
        raise OptionError("--device cuda was asked for, but torch sees no CUDA GPU",
                          found=f"torch {hw.torch_version}, CUDA build: {hw.cuda_version or 'no'}",
                          hint="use --device cpu (numerics are emulated faithfully), or install a CUDA build of torch")
    if emulate:
        if device == "cuda":
            raise OptionError("--emulate runs the emulation on the CPU; it cannot be combined with --device cuda",
                              hint="drop one of the two: --device cuda measures real kernels, --emulate emulates them")
        return "cpu", "emulated"
    torch_device = "cuda" if (device == "cuda" or (device == "auto" and hw.cuda_available)) else "cpu"
    return torch_device, ("cuda" if torch_device == "cuda" else "emulated")


def resolve_steps(steps: int | None, mode: str) -> int:
    """The timed steps per format: as asked, else 1 in cuda mode and 0 in emulated mode, where the CPU's timing
    of an emulated step says nothing about the target GPU (README.md, ``--steps``)."""
    if steps is not None:
        return steps
    return 1 if mode == "cuda" else 0


def select_formats(opts: AuditOptions, target: GpuSpec) -> tuple[tuple[Format, ...], list[dict[str, str]]]:
    requested = opts.formats or DEFAULT_FORMATS
    chosen, skipped = [], []
    for f in requested:
        if f is Format.FP32:
            continue  # the reference always runs
        if f not in CAPTURE_FORMATS:
            skipped.append({"format": f.value, "reason": FP8_SKIP_REASON if fp8_requested((f,)) else
                            f"not measured: {f} runs are not built yet in this version"})
        elif not target.supports(f.value):
            skipped.append({"format": f.value,
                            "reason": f"not a candidate: {target.name} (compute capability {target.cc_string}) "
                                      f"has no {f} Tensor Cores"
                                      + (" (TF32 needs Ampere, compute capability 8.0, or newer)"
                                         if f is Format.TF32 else "")})
        else:
            chosen.append(f)
    if not chosen and opts.formats and not fp8_requested(opts.formats):
        raise OptionError(
            f"none of the formats asked for can be audited on {target.name}",
            found=", ".join(f"{s['format']} ({s['reason']})" for s in skipped),
            choices=[f.value for f in CAPTURE_FORMATS if target.supports(f.value)],
            hint="drop --formats, or pick another --target",
        )
    return tuple(chosen), skipped


@dataclass(frozen=True)
class RunSetup:
    """The request met with this machine and the target: resolved once, before anything runs."""

    hardware: HardwareInfo
    target: GpuSpec
    target_reason: str
    formats: tuple[Format, ...]
    skipped: list[dict[str, str]]
    device: str
    mode: str
    steps: int
    kernels: str
    #: cuda mode: the CUDA device the audit runs on (the model's, else the current one; docs/gpu.md, "Devices")
    gpu_index: int | None = None

    @property
    def time_label(self) -> str:
        """Where measured times were measured, as audit.json labels them."""
        gpu = self.hardware.gpu(self.gpu_index) if self.mode == "cuda" else None
        if gpu is not None:
            return f"{gpu.name} (cuda)"
        return (f"this machine's {self.device.upper()} ("
                + ("emulated numerics; CPU time, not a GPU estimate" if self.mode == "emulated" else "cuda") + ")")


def set_up(opts: AuditOptions, model: torch.nn.Module | None = None) -> RunSetup:
    """The hardware, the target, the formats, the device, the mode, the timed steps and the kernels. In cuda mode
    the audit runs on the CUDA device ``model`` is on, else on the current one, and the default target is that
    GPU (docs/gpu.md, "Devices")."""
    hw = detect()
    device, mode = resolve_device(opts.device, opts.emulate, hw)
    index = None
    if mode == "cuda":
        index = model_cuda_index(model) if model is not None else None
        index = torch.cuda.current_device() if index is None else index
    if opts.target:
        target, target_reason = resolve_target(opts.target), "chosen with --target"
    else:
        target, target_reason = default_target(hw, index)
    formats, skipped = select_formats(opts, target)
    return RunSetup(hw, target, target_reason, formats, skipped, device, mode, resolve_steps(opts.steps, mode),
                    resolve_kernels(opts.kernels) if mode == "emulated" else "python", index)
