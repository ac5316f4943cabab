"""How an audit's request (:class:`~precision_audit.options.AuditOptions`) meets this machine and the target
(:class:`RunSetup`): the device and mode, the timed steps, the formats audited and those skipped (with why), the
emulation's kernels.

audit.py resolves it once at the start of an audit (:func:`set_up`); ``precision-audit verify`` resolves its
device here too. The options themselves are a leaf (precision_audit/options.py); this module is where they meet
the hardware, the target table and the stages' choices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .capture.model_state import model_cuda_index
from .emulation import resolve_kernels
from .errors import OptionError
from .formats import CAPTURE_FORMATS, DEFAULT_FORMATS, Format
from .fp8.audit import SKIP_REASON as FP8_SKIP_REASON
from .fp8.audit import requested as fp8_requested
from .gpus import GpuSpec, resolve_target
from .hardware import HardwareInfo, default_target, detect
from .options import AuditOptions, resolve_steps


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
