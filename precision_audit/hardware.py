"""What machine the audit runs on: CPU, CUDA GPUs (through torch and NVML), and the default target GPU.

Detection never raises on a machine without a GPU, a driver or NVML: what could not be found is recorded
(``nvml_status="not available: <why>"``, ``cuda_available=False``, no GPUs) so that the report can say so.
Hardware facts are gathered once, by :func:`detect`, and passed down as a :class:`HardwareInfo`.
"""

from __future__ import annotations

import logging
import os
import platform
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .gpus import DEFAULT_TARGET_KEY, GpuSpec, get_gpu, match_detected, supported_formats

__all__ = [
    "TRACKED_CPU_FLAGS",
    "CpuInfo",
    "GpuInfo",
    "HardwareInfo",
    "default_target",
    "detect",
    "detect_cpu",
]

logger = logging.getLogger(__name__)

#: CPU flags (as spelled in /proc/cpuinfo) that decide how fast low-precision math runs on the CPU itself.
TRACKED_CPU_FLAGS: tuple[str, ...] = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_fp16")

_CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class GpuInfo:
    """One CUDA GPU as detected (not a target-table row; see :func:`default_target` for that mapping).

    ``index`` is the CUDA (torch) device index when torch sees the GPU, else the NVML index.
    ``sm_count`` is ``None`` when only NVML saw the GPU. ``tensor_core_formats`` follows the compute
    capability rule of :func:`precision_audit.gpus.supported_formats`, without ``fp32`` (not a tensor-core
    format). ``source`` is ``"nvml+torch"``, ``"torch"`` or ``"nvml"``.

    Example::

        >>> GpuInfo(0, "NVIDIA T4", (7, 5), 16 * 2**30, None, 40, ("fp16",), "torch").to_dict()["name"]
        'NVIDIA T4'
    """

    index: int
    name: str
    compute_capability: tuple[int, int]
    memory_bytes: int
    driver_version: str | None
    sm_count: int | None
    tensor_core_formats: tuple[str, ...]
    source: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return {
            "index": self.index,
            "name": self.name,
            "compute_capability": list(self.compute_capability),
            "memory_bytes": self.memory_bytes,
            "driver_version": self.driver_version,
            "sm_count": self.sm_count,
            "tensor_core_formats": list(self.tensor_core_formats),
            "source": self.source,
        }


@dataclass(frozen=True)
class CpuInfo:
    """The host CPU: model name, logical cores, low-precision-relevant flags, torch's intra-op threads.

    ``flags`` lists the :data:`TRACKED_CPU_FLAGS` present (Linux only; empty elsewhere).

    Example::

        >>> cpu = detect_cpu()
        >>> cpu.logical_cores >= 1
        True
    """

    model: str
    logical_cores: int
    flags: tuple[str, ...]
    torch_threads: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return {
            "model": self.model,
            "logical_cores": self.logical_cores,
            "flags": list(self.flags),
            "torch_threads": self.torch_threads,
        }


@dataclass(frozen=True)
class HardwareInfo:
    """Everything :func:`detect` found, passed down to the stages that need it.

    Example::

        >>> hw = detect()
        >>> isinstance(hw.to_dict()["gpus"], list)
        True
    """

    cpu: CpuInfo
    gpus: tuple[GpuInfo, ...]
    cuda_available: bool
    torch_version: str
    cuda_version: str | None
    nvml_status: str
    python_version: str
    platform: str

    def gpu(self, index: int | None) -> GpuInfo | None:
        """The detected GPU with CUDA (torch) device index ``index``; the first one for ``None``, and ``None``
        when there is none."""
        if index is None:
            return self.gpus[0] if self.gpus else None
        return next((g for g in self.gpus if g.index == index), None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (``audit.json``'s ``hardware``)."""
        return {
            "cpu": self.cpu.to_dict(),
            "gpus": [gpu.to_dict() for gpu in self.gpus],
            "cuda_available": self.cuda_available,
            "torch_version": self.torch_version,
            "cuda_version": self.cuda_version,
            "nvml_status": self.nvml_status,
            "python_version": self.python_version,
            "platform": self.platform,
        }


# ---------------------------------------------------------------------------------------------------- CPU


def _parse_cpuinfo(text: str) -> tuple[str | None, frozenset[str]]:
    """The first ``model name`` and the first ``flags`` line of /proc/cpuinfo."""
    model: str | None = None
    flags: frozenset[str] | None = None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip() or None
        elif key == "flags" and flags is None:
            flags = frozenset(value.split())
        if model is not None and flags is not None:
            break
    return model, flags or frozenset()


def detect_cpu(cpuinfo_path: str | os.PathLike[str] = _CPUINFO) -> CpuInfo:
    """Describe the host CPU.

    The model name and flags come from ``cpuinfo_path`` (``/proc/cpuinfo``) when it can be read; elsewhere
    the model is ``platform.processor()`` (or the machine type) and no flags are reported.

    Example::

        >>> cpu = detect_cpu()
        >>> set(cpu.flags) <= set(TRACKED_CPU_FLAGS)
        True
    """
    model: str | None = None
    flags: frozenset[str] = frozenset()
    try:
        text = Path(cpuinfo_path).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        logger.debug("cannot read %s: %s", cpuinfo_path, e)
    else:
        model, flags = _parse_cpuinfo(text)
    if not model:
        model = platform.processor() or platform.machine() or "unknown"
    return CpuInfo(
        model=model,
        logical_cores=os.cpu_count() or 1,
        flags=tuple(flag for flag in TRACKED_CPU_FLAGS if flag in flags),
        torch_threads=torch.get_num_threads(),
    )


# ---------------------------------------------------------------------------------------------------- GPUs


@dataclass(frozen=True)
class _Device:
    """A GPU as one source (torch or NVML) reports it."""

    index: int
    name: str
    compute_capability: tuple[int, int]
    memory_bytes: int
    sm_count: int | None
    uuid: str | None


def _as_str(value: Any) -> str:
    # Older nvidia-ml-py versions return bytes.
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def _norm_uuid(uuid: Any) -> str | None:
    if uuid is None:
        return None
    text = _as_str(uuid).strip().lower()
    text = text.removeprefix("gpu-")
    return text or None


def _torch_devices() -> tuple[bool, list[_Device]]:
    """``(cuda_available, devices)`` as torch sees them (respects CUDA_VISIBLE_DEVICES)."""
    try:
        available = bool(torch.cuda.is_available())
    except Exception as e:  # a broken driver install must not stop a CPU audit
        logger.warning("torch.cuda.is_available() failed: %s", e)
        return False, []
    if not available:
        return False, []
    devices: list[_Device] = []
    try:
        count = torch.cuda.device_count()
        for i in range(count):
            props = torch.cuda.get_device_properties(i)
            devices.append(
                _Device(
                    index=i,
                    name=str(props.name),
                    compute_capability=(int(props.major), int(props.minor)),
                    memory_bytes=int(props.total_memory),
                    sm_count=int(props.multi_processor_count),
                    uuid=_norm_uuid(getattr(props, "uuid", None)),
                )
            )
    except (RuntimeError, AssertionError) as e:
        logger.warning("could not read CUDA device properties: %s", e)
    return True, devices


@dataclass(frozen=True)
class _NvmlResult:
    status: str
    driver_version: str | None
    devices: tuple[_Device, ...]


def _query_nvml() -> _NvmlResult:
    """Ask NVML for the driver version and the GPUs; never raises."""
    try:
        with warnings.catch_warnings():
            # The deprecated `pynvml` shim package warns on import; nvidia-ml-py is what we use either way.
            warnings.simplefilter("ignore", FutureWarning)
            import pynvml
    except ImportError as e:
        return _NvmlResult(f"not available: nvidia-ml-py is not installed ({e})", None, ())

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return _NvmlResult(f"not available: {e}", None, ())

    driver: str | None = None
    devices: list[_Device] = []
    status = "ok"
    try:
        driver = _as_str(pynvml.nvmlSystemGetDriverVersion())
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                uuid = _norm_uuid(pynvml.nvmlDeviceGetUUID(handle))
            except pynvml.NVMLError:
                uuid = None
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            devices.append(
                _Device(
                    index=i,
                    name=_as_str(pynvml.nvmlDeviceGetName(handle)),
                    compute_capability=(int(major), int(minor)),
                    memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                    sm_count=None,
                    uuid=uuid,
                )
            )
    except pynvml.NVMLError as e:
        status = f"not available: query failed: {e}"
        devices = []
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as e:
            logger.debug("nvmlShutdown failed: %s", e)
    return _NvmlResult(status, driver, tuple(devices))


def _merge(torch_devs: list[_Device], nvml: _NvmlResult) -> tuple[GpuInfo, ...]:
    """Combine torch's and NVML's views. NVML indices need not follow CUDA's order (and ignore
    CUDA_VISIBLE_DEVICES), so devices are paired by UUID, or by index only when the names agree."""
    gpus: list[GpuInfo] = []
    if torch_devs:
        by_uuid = {d.uuid: d for d in nvml.devices if d.uuid}
        by_index = {d.index: d for d in nvml.devices}
        for dev in torch_devs:
            twin = by_uuid.get(dev.uuid) if dev.uuid else None
            if twin is None:
                candidate = by_index.get(dev.index)
                if candidate is not None and candidate.name == dev.name:
                    twin = candidate
            gpus.append(
                GpuInfo(
                    index=dev.index,
                    name=dev.name,
                    compute_capability=dev.compute_capability,
                    memory_bytes=dev.memory_bytes,
                    driver_version=nvml.driver_version,
                    sm_count=dev.sm_count,
                    tensor_core_formats=_tensor_core_formats(dev.compute_capability),
                    source="nvml+torch" if twin is not None else "torch",
                )
            )
    else:
        # torch cannot use the GPU (CPU-only build, or driver too old), but it is there: still worth knowing.
        for dev in nvml.devices:
            gpus.append(
                GpuInfo(
                    index=dev.index,
                    name=dev.name,
                    compute_capability=dev.compute_capability,
                    memory_bytes=dev.memory_bytes,
                    driver_version=nvml.driver_version,
                    sm_count=None,
                    tensor_core_formats=_tensor_core_formats(dev.compute_capability),
                    source="nvml",
                )
            )
    return tuple(gpus)


def _tensor_core_formats(compute_capability: tuple[int, int]) -> tuple[str, ...]:
    return tuple(fmt for fmt in supported_formats(compute_capability) if fmt != "fp32")


def detect() -> HardwareInfo:
    """Detect the CPU, the CUDA GPUs and the software versions. Never raises for a missing GPU or NVML.

    Example::

        >>> hw = detect()
        >>> hw.cuda_available in (True, False) and hw.nvml_status.startswith(("ok", "not available"))
        True
    """
    cuda_available, torch_devs = _torch_devices()
    nvml = _query_nvml()
    gpus = _merge(torch_devs, nvml)
    info = HardwareInfo(
        cpu=detect_cpu(),
        gpus=gpus,
        cuda_available=cuda_available,
        torch_version=str(torch.__version__),
        cuda_version=torch.version.cuda,
        nvml_status=nvml.status,
        python_version=platform.python_version(),
        platform=platform.platform(),
    )
    logger.debug(
        "hardware: cuda_available=%s, gpus=%s, nvml=%s",
        cuda_available,
        [g.name for g in gpus],
        nvml.status,
    )
    return info


def default_target(hw: HardwareInfo, index: int | None = None) -> tuple[GpuSpec, str]:
    """The target GPU to plan for when the user gives none, and why.

    The detected GPU the audit runs on (CUDA device ``index``; the first one found for ``None``) when it is in the
    table; otherwise H100 SXM (``DEFAULT_TARGET_KEY``).

    Example::

        >>> spec, why = default_target(detect())  # on a machine without a GPU:
        >>> spec.key, why  # doctest: +SKIP
        ('h100-sxm', 'no GPU detected; default target H100 SXM')
    """
    fallback = get_gpu(DEFAULT_TARGET_KEY)
    gpu = hw.gpu(index) or hw.gpu(None)
    if gpu is None:
        return fallback, f"no GPU detected; default target {fallback.name}"
    spec = match_detected(gpu.name, gpu.compute_capability, gpu.memory_bytes)
    if spec is None:
        reason = (
            f"detected GPU {gpu.name!r} (compute capability {gpu.compute_capability[0]}."
            f"{gpu.compute_capability[1]}) is not in the table; default target {fallback.name} "
            "(choose another with --target)"
        )
        logger.warning("%s", reason)
        return fallback, reason
    reason = f"detected {gpu.name}"
    if len(hw.gpus) > 1:
        reason += (f" (GPU {gpu.index} of {len(hw.gpus)}, the one the audit runs on)" if gpu.index == index
                   else f" (GPU {gpu.index}, first of {len(hw.gpus)})")
    return spec, reason
