"""The GPU the audit runs on (issue 31 item 7): the model's own CUDA device, else the current one, is where the passes
run, whose name the report gives and which the default target is; a model on cuda:1 is not moved to cuda:0
(capture/model_state.py, options.py ``set_up``; docs/gpu.md, "Devices")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import precision_audit
from fakecuda import REAL_CUDA, FakeCuda, FakeDeviceProperties
from precision_audit.capture.model_state import ModelState

H100 = FakeDeviceProperties(uuid="GPU-0f0f0f0f-fake-cuda-0000-000000000000")
H200 = FakeDeviceProperties(name="NVIDIA H200", total_memory=150_754_820_096,
                            uuid="GPU-0f0f0f0f-fake-cuda-0000-000000000001")


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_the_audit_names_and_targets_the_gpu_it_runs_on_not_the_first_one_found():
    """Two different GPUs, the second current (as torchrun's set_device(LOCAL_RANK) makes it): the target, the
    measured step times and the timed GEMMs are the H200's, not those of GPU 0, the H100."""
    torch.manual_seed(0)
    with FakeCuda(device_count=2, device_props=(H100, H200)) as fake:
        torch.cuda.set_device(1)
        r = precision_audit.audit(_Tiny(), torch.randn(4, 8), steps=1, formats="bf16", progress=False)
        assert fake.current == 1, "the audit puts the current device back"
    a = r.audit
    assert a["target"]["key"] == "h200" and a["target"]["reason"] == \
        "detected NVIDIA H200 (GPU 1 of 2, the one the audit runs on)"
    assert a["summary"]["bf16"]["step_time"]["measured_on"] == "NVIDIA H200 (cuda)"
    timed = [f["measured"]["measured_on"] for L in a["layers"] for f in (L.get("alignment") or []) if f.get("measured")]
    assert timed and set(timed) == {"NVIDIA H200"}, timed


class _OnCuda1(torch.Tensor):
    """A tensor that says it is on cuda:1, without a GPU (its values are a CPU tensor it wraps)."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device="cuda:1",
                                                requires_grad=inner.requires_grad)
        t.inner = inner
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return _OnCuda1(args[0].inner)
        raise NotImplementedError(f"{func} on a tensor standing for cuda:1")


def test_a_model_on_cuda_1_is_audited_there_not_moved_to_the_current_device():
    """On main the session compared the model's device with torch.device("cuda") (no index), found cuda:1 different,
    and moved the model to the current device; the audit now runs on cuda:1, and nothing moves."""
    from precision_audit.capture.model_state import model_cuda_index
    from precision_audit.options import AuditOptions, set_up

    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(_OnCuda1(torch.randn(4, 4)))
    model.bias = nn.Parameter(_OnCuda1(torch.randn(4)))
    with FakeCuda(device_count=2):
        assert torch.cuda.current_device() == 0 and model_cuda_index(model) == 1
        setup = set_up(AuditOptions(model="m.py", device="cuda"), model)
        assert setup.gpu_index == 1 and setup.device == "cuda"
        with torch.cuda.device(setup.gpu_index):  # as compute_audit runs the passes
            state = ModelState(model, setup.device)
            assert not state.moved, "the model is already on the audit's device"
        assert model_cuda_index(nn.Linear(2, 2)) is None  # a CPU model: the audit's current device
        assert set_up(AuditOptions(model="m.py", device="cuda"), nn.Linear(2, 2)).gpu_index == 0


@pytest.mark.gpu
@pytest.mark.skipif(not REAL_CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_model_on_the_second_gpu_stays_there_on_real_gpus():
    torch.manual_seed(0)
    model = _Tiny().to("cuda:1")
    before = torch.cuda.memory_allocated(0)
    r = precision_audit.audit(model, torch.randn(64, 8, device="cuda:1"), steps=1, formats="bf16", progress=False)
    assert all(p.device == torch.device("cuda:1") for p in model.parameters())
    assert torch.cuda.memory_allocated(0) == before, "nothing of the audit on cuda:0"
    assert r.audit["summary"]["bf16"]["step_time"]["measured_on"] == f"{torch.cuda.get_device_name(1)} (cuda)"
