"""Hardware detection: works without a GPU, parses the CPU, merges torch and NVML, picks a default target."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from precision_audit import hardware
from precision_audit.hardware import (
    TRACKED_CPU_FLAGS,
    CpuInfo,
    GpuInfo,
    HardwareInfo,
    default_target,
    detect,
    detect_cpu,
)

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")


# --------------------------------------------------------------------------------------- a fake NVML


class FakeNVMLError(Exception):
    pass


def fake_pynvml(
    devices: list[dict[str, Any]] | None = None,
    *,
    init_error: str | None = None,
    fail_on: str | None = None,
) -> types.ModuleType:
    """A stand-in for nvidia-ml-py's ``pynvml`` module that records calls."""
    mod = types.ModuleType("pynvml")
    mod.__dict__.update(NVMLError=FakeNVMLError, calls=[])
    devs = devices or []

    def call(name: str, result: Any = None) -> Any:
        mod.calls.append(name)  # type: ignore[attr-defined]
        if fail_on == name:
            raise FakeNVMLError(f"{name} failed")
        return result

    def nvmlInit() -> None:
        mod.calls.append("nvmlInit")  # type: ignore[attr-defined]
        if init_error:
            raise FakeNVMLError(init_error)

    mod.__dict__.update(
        nvmlInit=nvmlInit,
        nvmlShutdown=lambda: call("nvmlShutdown"),
        nvmlSystemGetDriverVersion=lambda: call("nvmlSystemGetDriverVersion", "550.54.15"),
        nvmlDeviceGetCount=lambda: call("nvmlDeviceGetCount", len(devs)),
        nvmlDeviceGetHandleByIndex=lambda i: call("nvmlDeviceGetHandleByIndex", devs[i]),
        nvmlDeviceGetName=lambda h: call("nvmlDeviceGetName", h["name"]),
        nvmlDeviceGetUUID=lambda h: call("nvmlDeviceGetUUID", h.get("uuid", "GPU-0000")),
        nvmlDeviceGetCudaComputeCapability=lambda h: call("nvmlDeviceGetCudaComputeCapability", h["cc"]),
        nvmlDeviceGetMemoryInfo=lambda h: call(
            "nvmlDeviceGetMemoryInfo", types.SimpleNamespace(total=h["memory"], free=0, used=0)
        ),
    )
    return mod


H100 = {"name": "NVIDIA H100 80GB HBM3", "cc": (9, 0), "memory": 80 * 1024**3, "uuid": "GPU-aaaa-1111"}


def fake_torch_cuda(monkeypatch: pytest.MonkeyPatch, props: list[types.SimpleNamespace]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])


def torch_props(name: str, cc: tuple[int, int], sms: int, memory: int, uuid: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name=name, major=cc[0], minor=cc[1], total_memory=memory, multi_processor_count=sms, uuid=uuid
    )


def no_torch_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# --------------------------------------------------------------------------------- the real machine


@no_cuda
def test_detect_without_gpu_reports_why() -> None:
    hw = detect()
    assert hw.cuda_available is False
    assert hw.gpus == ()
    assert hw.nvml_status.startswith("not available"), hw.nvml_status
    assert hw.cpu.logical_cores >= 1
    assert hw.cpu.torch_threads == torch.get_num_threads()
    assert hw.torch_version == torch.__version__
    assert hw.cuda_version == torch.version.cuda
    data = json.loads(json.dumps(hw.to_dict()))
    assert data["gpus"] == [] and data["cpu"]["logical_cores"] == hw.cpu.logical_cores


@no_cuda
def test_default_target_without_gpu_is_h100_with_reason() -> None:
    spec, why = default_target(detect())
    assert spec.key == "h100-sxm"
    assert "no GPU" in why and "H100 SXM" in why


def test_detect_cpu_on_this_machine() -> None:
    cpu = detect_cpu()
    assert isinstance(cpu, CpuInfo)
    assert cpu.model
    assert cpu.logical_cores >= 1
    assert set(cpu.flags) <= set(TRACKED_CPU_FLAGS)


# ------------------------------------------------------------------------------------------- CPU parse

CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16 avx512_fp16
processor\t: 1
model name\t: should not be read
flags\t\t: fpu amx_fp16
"""


def test_detect_cpu_parses_cpuinfo(tmp_path: Path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    cpu = detect_cpu(path)
    assert cpu.model == "Intel(R) Xeon(R) Platinum 8480+"
    # Tracked flags in the fixed order; avx512_fp16 / amx_tile are not tracked; only the first CPU's flags.
    assert cpu.flags == ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def test_detect_cpu_without_cpuinfo(tmp_path: Path) -> None:
    cpu = detect_cpu(tmp_path / "missing")
    assert cpu.flags == ()
    assert cpu.model  # platform.processor()/machine() fallback, never empty


# ------------------------------------------------------------------------------------------- NVML paths


def test_nvml_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    no_torch_cuda(monkeypatch)
    hw = detect()
    assert hw.nvml_status.startswith("not available: nvidia-ml-py is not installed")
    assert hw.gpus == ()


def test_nvml_init_failure_is_recorded_and_not_shut_down(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake_pynvml(init_error="NVML Shared Library Not Found")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    no_torch_cuda(monkeypatch)
    hw = detect()
    assert hw.nvml_status == "not available: NVML Shared Library Not Found"
    assert "nvmlShutdown" not in nvml.calls  # type: ignore[attr-defined]


def test_nvml_query_failure_still_shuts_down(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake_pynvml([H100], fail_on="nvmlDeviceGetCudaComputeCapability")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    no_torch_cuda(monkeypatch)
    hw = detect()
    assert hw.nvml_status.startswith("not available: query failed")
    assert hw.gpus == ()
    assert nvml.calls[-1] == "nvmlShutdown"  # type: ignore[attr-defined]


def test_nvml_only_gpu_when_torch_has_no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake_pynvml([H100])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    no_torch_cuda(monkeypatch)
    hw = detect()
    assert hw.nvml_status == "ok"
    assert hw.cuda_available is False
    (gpu,) = hw.gpus
    assert gpu == GpuInfo(
        index=0,
        name="NVIDIA H100 80GB HBM3",
        compute_capability=(9, 0),
        memory_bytes=80 * 1024**3,
        driver_version="550.54.15",
        sm_count=None,
        tensor_core_formats=("tf32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"),
        source="nvml",
    )
    assert nvml.calls[0] == "nvmlInit" and nvml.calls[-1] == "nvmlShutdown"  # type: ignore[attr-defined]
    spec, why = default_target(hw)
    assert spec.key == "h100-sxm"
    assert why == "detected NVIDIA H100 80GB HBM3"


def test_torch_and_nvml_paired_by_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    t4 = {"name": "Tesla T4", "cc": (7, 5), "memory": 15 * 1024**3, "uuid": "GPU-bbbb-2222"}
    # NVML lists the H100 first, torch (CUDA_VISIBLE_DEVICES) only the T4: pairing must use the UUID.
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([H100, t4]))
    fake_torch_cuda(monkeypatch, [torch_props("Tesla T4", (7, 5), 40, 15 * 1024**3, "bbbb-2222")])
    hw = detect()
    assert hw.cuda_available is True
    (gpu,) = hw.gpus
    assert (gpu.index, gpu.name, gpu.sm_count, gpu.source) == (0, "Tesla T4", 40, "nvml+torch")
    assert gpu.tensor_core_formats == ("fp16",)
    assert gpu.driver_version == "550.54.15"
    spec, why = default_target(hw)
    assert spec.key == "t4" and why == "detected Tesla T4"
    assert spec.candidate_formats() == ("fp32", "fp16")


def test_torch_only_when_nvml_does_not_know_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error="Driver Not Loaded"))
    fake_torch_cuda(monkeypatch, [torch_props("NVIDIA A10", (8, 6), 72, 24 * 1024**3, "cccc")])
    hw = detect()
    (gpu,) = hw.gpus
    assert gpu.source == "torch" and gpu.driver_version is None
    assert default_target(hw)[0].key == "a10"


# -------------------------------------------------------------------------------------- default target


def _hw(*gpus: GpuInfo) -> HardwareInfo:
    cpu = CpuInfo(model="test", logical_cores=2, flags=(), torch_threads=2)
    return HardwareInfo(cpu, tuple(gpus), bool(gpus), "2.13.0", None, "ok", "3.11", "Linux")


def _gpu(name: str, cc: tuple[int, int], index: int = 0) -> GpuInfo:
    return GpuInfo(index, name, cc, 24 * 1024**3, None, 80, hardware._tensor_core_formats(cc), "torch")


def test_default_target_for_a_gpu_not_in_the_table() -> None:
    spec, why = default_target(_hw(_gpu("NVIDIA A10G", (8, 6))))
    assert spec.key == "h100-sxm"
    assert "'NVIDIA A10G'" in why and "not in the table" in why and "--target" in why


def test_default_target_uses_the_first_of_several_gpus() -> None:
    spec, why = default_target(_hw(_gpu("NVIDIA L4", (8, 9)), _gpu("NVIDIA A10", (8, 6), 1)))
    assert spec.key == "l4"
    assert why == "detected NVIDIA L4 (GPU 0, first of 2)"


def test_hardware_to_dict_round_trips_through_json() -> None:
    hw = _hw(_gpu("Tesla V100-SXM2-16GB", (7, 0)))
    data = json.loads(json.dumps(hw.to_dict()))
    assert data["gpus"][0]["compute_capability"] == [7, 0]
    assert data["gpus"][0]["tensor_core_formats"] == ["fp16"]
    assert set(data) == {"cpu", "gpus", "cuda_available", "torch_version", "cuda_version", "nvml_status",
                         "python_version", "platform"}


def test_default_target_is_the_gpu_the_audit_runs_on() -> None:
    hw = _hw(_gpu("NVIDIA L4", (8, 9)), _gpu("NVIDIA A10", (8, 6), 1))
    spec, why = default_target(hw, 1)
    assert spec.key == "a10"
    assert why == "detected NVIDIA A10 (GPU 1 of 2, the one the audit runs on)"
    assert hw.gpu(1) is hw.gpus[1] and hw.gpu(None) is hw.gpus[0] and hw.gpu(5) is None
