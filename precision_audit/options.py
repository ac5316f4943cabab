"""What an audit is asked to do: :class:`AuditOptions` (everything the command line can set), the error
:class:`Budget` a format must meet, and the closed choices of ``--device`` and ``--kernels``.

A leaf, as torchao's float8 config is: it imports only torch's neighbours errors.py and formats.py, never a
stage, so that every stage can read its options and none is imported to configure another. How the options meet
this machine and the target (the device and mode, the formats, the timed steps) is
precision_audit/run_setup.py's :func:`~precision_audit.run_setup.set_up`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from .errors import SEED_MAX, SEED_MIN, OptionError
from .formats import Format, parse_formats

#: ``--device``: ``auto`` takes a CUDA GPU when torch sees one (README.md, ``--device``).
DeviceChoice = Literal["auto", "cuda", "cpu"]
DEVICE_CHOICES: tuple[str, ...] = get_args(DeviceChoice)
#: ``--kernels``: how emulated mode runs its rounding kernels (docs/emulation.md, "Compiled kernels"); ``auto``
#: takes the compiled ones when they are built.
KernelChoice = Literal["auto", "python", "compiled"]
KERNEL_CHOICES: tuple[str, ...] = get_args(KernelChoice)
#: the --formats names that ask for the FP8 stage (precision_audit/fp8/audit.py)
_FP8_FORMATS = (Format.FP8_E4M3, Format.FP8_E5M2)


@dataclass(frozen=True)
class Budget:
    """The error budget a format must meet to count as safe, relative to FP32.

    ``max_loss_rel_change``: |L_p - L_fp32| / |L_fp32|; ``max_output_rel_error``: relative L2 error of the
    model's output.
    """

    max_loss_rel_change: float = 1e-2
    max_output_rel_error: float = 5e-2

    def __post_init__(self) -> None:
        for name in ("max_loss_rel_change", "max_output_rel_error"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"Budget.{name} must be a positive finite number, got {v!r}")

    def to_dict(self) -> dict[str, float]:
        return {"max_loss_rel_change": self.max_loss_rel_change, "max_output_rel_error": self.max_output_rel_error}


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
    device: DeviceChoice = "auto"
    emulate: bool = False
    steps: int | None = None  # None: 1 in cuda mode, 0 in emulated mode (see resolve_steps)
    seed: int = 0
    budget: Budget = field(default_factory=Budget)
    kernels: KernelChoice = "auto"
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
        if t is not None and not any(f in _FP8_FORMATS for f in self.formats or ()):
            raise OptionError("--tokens-per-step prices the FP8 plan, and no FP8 format is audited",
                              found=f"--formats {','.join(f.value for f in self.formats or ())}",
                              hint="add fp8_e4m3 to --formats, or leave --tokens-per-step out")
        if self.device not in DEVICE_CHOICES:
            raise OptionError(f"unknown --device {self.device!r}", choices=DEVICE_CHOICES)
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
            raise wrong("budget", "a precision_audit.options.Budget")


def resolve_steps(steps: int | None, mode: str) -> int:
    """The timed steps per format: as asked, else 1 in cuda mode and 0 in emulated mode, where the CPU's timing
    of an emulated step says nothing about the target GPU (README.md, ``--steps``)."""
    if steps is not None:
        return steps
    return 1 if mode == "cuda" else 0
