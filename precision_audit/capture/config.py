"""How to run the capture (:class:`CaptureConfig`): the capture stage's one input besides the model, its forward
and its loss, set by audit.py from the resolved options (precision_audit/run_setup.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..formats import LOW_PRECISION_DTYPES, Format


@dataclass(frozen=True)
class CaptureConfig:
    """How to run the capture.

    ``mode`` is ``"cuda"`` (real ``torch.autocast("cuda")``) or ``"emulated"`` (CUDA autocast's policy and
    Tensor Core rounding computed on any device). ``loss_scales`` maps a format to the loss scale its
    backward uses (FP16 needs one; BF16 does not).
    """

    formats: tuple[Format, ...]
    device: str = "cpu"
    mode: str = "emulated"
    seed: int = 0
    timed_steps: int = 1
    kernels: str = "python"  # emulated mode: "python" or "compiled" (see emulation/compiled.py)

    def __post_init__(self) -> None:
        if self.mode not in ("cuda", "emulated"):
            raise ValueError(f"mode must be 'cuda' or 'emulated', got {self.mode!r}")
        if self.mode == "cuda" and not self.device.startswith("cuda"):
            raise ValueError("mode 'cuda' needs a cuda device")
        for f in self.formats:
            if f not in LOW_PRECISION_DTYPES and f is not Format.TF32:
                raise ValueError(f"format {f} cannot be captured (capturable: fp16, bf16, tf32)")
        if self.timed_steps < 0:
            raise ValueError("timed_steps must be >= 0")
