"""The noise floor's forwards in cuda mode (capture/noise.py), under the fake device (tests/fakecuda.py): they see
the FP32 reference's dropout masks as every other pass does, and an out-of-memory error in them stops the audit
instead of becoming a format's or a plan's error (issue 31, defects 2 and 6)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fakecuda import FakeCuda
from models import DtypeDependentDraws
from precision_audit.capture import CaptureConfig, CaptureSession
from precision_audit.capture.noise import measure_noise_floor, plan_forward
from precision_audit.formats import Format
from precision_audit.model_names import fingerprint, model_layout
from precision_audit.policy.schema import LossScaling, ModuleOverride, Policy


class OomWhenAsked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.oom = False

    def forward(self, x):
        if self.oom:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return self.lin(x)


def _policy(model: nn.Module, default: str, overrides: dict[str, str] | None = None) -> Policy:
    fp, n = fingerprint(model)
    return Policy(model_class=type(model).__name__, model_fingerprint=fp, model_modules=n, target_name="test",
                  target_compute_capability=None, default_format=default,
                  modules={k: ModuleOverride(v, "test") for k, v in (overrides or {}).items()},
                  loss_scaling=LossScaling(), model_layout=model_layout(model))


def _session(model: nn.Module, x: torch.Tensor) -> CaptureSession:
    return CaptureSession(model, lambda m: m(x), lambda out: out.float().pow(2).mean(),
                          CaptureConfig(formats=(Format.BF16,), device="cuda", mode="cuda", timed_steps=0))


def test_the_second_order_forwards_see_the_reference_masks():
    """bf16 alone moves the output by ~4e-3; another mask on half of the hidden units moves it by order 1. Before,
    the format forward and the plan's forward at the second order drew their own masks: 1.0 there against 4e-3 at
    the first, so bf16 read unsafe and every plan failed its verification."""
    with FakeCuda(cuda_dropout=True):
        torch.manual_seed(0)
        model = DtypeDependentDraws().train().to("cuda")
        x = torch.randn(64, 32, device="cuda")
        with _session(model, x) as s:
            s.reference_run()
            main = s.format_run(Format.BF16).output.rel_l2
            noise = measure_noise_floor(s, (Format.BF16,))
            second = noise.runs[Format.BF16].output_rel_error
            plan = plan_forward(s, noise, _policy(model, "bf16"), Format.BF16).output_rel_error
            plan_fp32 = plan_forward(s, noise, _policy(model, "fp32"), None).output_rel_error
    assert 1e-4 < main < 0.02, main
    assert second is not None and second <= 2 * main, f"second order {second:.3g} against {main:.3g} at the first"
    assert plan is not None and plan <= 2 * main, f"the plan's forward at the second order: {plan:.3g}"
    # the FP32 forward at the second order and an all-fp32 plan draw the reference's masks exactly
    assert noise.output_rel_error == 0.0 and plan_fp32 == 0.0


def test_oom_in_the_second_orders_plan_forward_stops_the_audit():
    """docs/gpu.md, "Out of memory": never a broken plan (it read as one: the plan was repaired or refused)."""
    with FakeCuda():
        model = nn.Sequential(OomWhenAsked(), nn.Linear(16, 4)).to("cuda")
        x = torch.randn(4, 16, device="cuda")
        with _session(model, x) as s:
            s.reference_run()
            s.format_run(Format.BF16)
            noise = measure_noise_floor(s, (Format.BF16,))
            model[0].oom = True
            with pytest.raises(torch.OutOfMemoryError):
                plan_forward(s, noise, _policy(model, "bf16"), Format.BF16)


def test_oom_in_a_format_forward_at_the_second_order_stops_the_audit():
    """Not the format's error at that order (it read as 'error: OutOfMemoryError' beside the figure)."""
    with FakeCuda():
        model = nn.Sequential(OomWhenAsked(), nn.Linear(16, 4)).to("cuda")
        x = torch.randn(4, 16, device="cuda")
        with _session(model, x) as s:
            s.reference_run()
            s.format_run(Format.BF16)
            real_autocast = s._autocast

            def oom_under_autocast(fmt):
                model[0].oom = True  # the second order's format forward: the device runs out of memory
                return real_autocast(fmt)
            s._autocast = oom_under_autocast
            with pytest.raises(torch.OutOfMemoryError):
                measure_noise_floor(s, (Format.BF16,))
