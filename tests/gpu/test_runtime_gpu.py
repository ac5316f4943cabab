"""The runtime on the GPU: per-module formats under torch's CUDA autocast, and non-finite steps skipped, counted
and blamed on their module with a real GradScaler (docs/policy.md, "The runtime").

The same acceptance case as tests/runtime/test_runtime_nonfinite.py (a module whose output overflows every 5th
step, 30 steps), on ``cuda``: on a real GPU (``gpu`` marker) with CUDA autocast, the CUDA GradScaler and its
fused unscale kernel; on the fake device (tests/fakecuda.py) the same code paths on CPU tensors.
Run the real ones with: python -m pytest -m gpu tests/gpu/test_runtime_gpu.py -q
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from runtime.test_runtime_nonfinite import INJECTED, Net, make_policy, train

import precision_audit as pa
from fakecuda import gpu  # noqa: F401 - the fixture
from precision_audit.policy import ModuleOverride


@pytest.mark.parametrize("default,scaling", [("bf16", False), ("fp16", True)], ids=["bf16", "fp16-scaler"])
def test_non_finite_steps_are_skipped_and_blamed_on_the_gpu(default, scaling, gpu):
    model, ctl, records, unchanged, handle = train(default, scaling, device="cuda")
    handle.remove()
    ctl.close()
    where = "cuda" if gpu.real else "cpu"  # the fake device's "cuda" tensors are CPU tensors
    assert all(p.device.type == where and bool(torch.isfinite(p).all()) for p in model.parameters())
    assert [r.step for r in records if r.skipped] == INJECTED
    assert unchanged == [r.skipped for r in records], "a skipped step leaves the parameters bit-identical"
    assert all(r.sources == ("mid",) for r in records if r.skipped), [r.sources for r in records]
    clean = [r.loss for r in records if not r.skipped]
    assert all(math.isfinite(v) for v in clean) and clean[-1] < clean[0], "the clean steps should train"
    scales = [r.scale for r in records]
    if scaling:  # the GradScaler backs off by its factor at every skipped step and never grows (interval 10000)
        assert scales[0] == 1024.0
        for r, before in zip(records[1:], records):
            assert r.scale == (before.scale * 0.5 if before.skipped else before.scale), scales
    else:
        assert scales == [None] * len(records)


def test_module_overrides_set_each_modules_format_under_cuda_autocast(gpu):
    torch.manual_seed(0)
    model = Net().to("cuda")
    policy = dataclasses.replace(make_policy(model, "bf16", False),
                                 modules={"out": ModuleOverride("fp32", "kept in FP32 by the test")})
    seen: dict[str, torch.dtype] = {}
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, o.dtype))
             for n, m in model.named_modules() if n in ("inp", "mid.lin", "out")]
    with pa.apply_policy(model, policy, device_type="cuda"), pa.autocast(policy, "cuda"):
        model(torch.randn(4, 16, device="cuda"))
    for h in hooks:
        h.remove()
    assert seen == {"inp": torch.bfloat16, "mid.lin": torch.bfloat16, "out": torch.float32}, seen
