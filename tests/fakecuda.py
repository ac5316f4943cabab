"""A fake CUDA device on the CPU, so that the cuda-mode code paths run in CI on machines without a GPU.

What it checks, and what it does not: it runs the code a GPU user runs first (``--device cuda``: device
detection, NVML, ``.to("cuda")``, ``torch.autocast("cuda")``, CUDA RNG seeding and restoring, CUDA events,
peak-memory statistics, the profiler set-up, the GEMM benchmarks) end to end, so that a KeyError, a wrong
API call or a swallowed error in that plumbing fails a test. It does **not** check GPU numerics or GPU
speed: every "cuda" tensor is a CPU tensor, every timing is CPU wall-clock, and the memory counters are
plain numbers a test can drive (``FakeCuda.memory``). The real-GPU tests (``tests/gpu``, ``gpu`` marker)
are what check numbers on a machine with a GPU.

How each part is faked:

- ``torch.cuda.*`` functions the project calls (``is_available``, ``device_count``, ``get_device_properties``
  with an H100-like record, ``get_device_name``, ``synchronize``, ``Event``, RNG state per device, memory
  statistics) are replaced for the duration of the context;
- tensors: a ``TorchFunctionMode`` rewrites every ``device="cuda"`` argument (and ``Tensor.to("cuda")``,
  ``Tensor.cuda()``, ``pin_memory()``) to the CPU;
- ``torch.autocast("cuda", dtype)``: CUDA autocast cannot act on CPU tensors, so it is routed to the
  project's emulation of CUDA autocast (``CudaAutocastPolicy`` + ``torch.autocast("cpu", dtype)``; see
  docs/emulation.md, "In short"), and ``torch.is_autocast_enabled("cuda")`` /
  ``torch.get_autocast_dtype("cuda")`` answer for it;
- NVML: a fake ``pynvml`` module (the calls ``precision_audit/hardware.py`` makes) reports the same GPU;
- the profiler is asked for CPU activity only (Kineto has no CUDA here);
- pinned host memory (``pin_memory=True``): a CPU tensor, counted by a model of CUDA's caching host allocator
  (``FakeCuda.host``: blocks rounded up to a power of two, a freed block cached until
  ``torch.accelerator.empty_host_cache()``);
- with ``cuda_dropout=True``, ``F.dropout`` in training runs ``native_dropout`` as on CUDA, whose mask depends on
  the input's dtype at the same generator state (CUDA's kernel advances each element's RNG offset by a
  dtype-dependent unroll): the same seed then gives other masks in fp16/bf16 than in fp32.

Example::

    with FakeCuda() as fake:
        assert torch.cuda.is_available()
        x = torch.ones(3, device="cuda")        # a CPU tensor
        fake.memory.allocate(2**20)             # drive the peak-memory counters
"""

from __future__ import annotations

import contextlib
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_MISSING = object()


@dataclass(frozen=True)
class FakeDeviceProperties:
    """The fields of ``torch.cuda.get_device_properties`` the project reads (an H100 SXM by default)."""

    name: str = "NVIDIA H100 80GB HBM3"
    major: int = 9
    minor: int = 0
    total_memory: int = 85_031_714_816
    multi_processor_count: int = 132
    uuid: str = "GPU-0f0f0f0f-fake-cuda-0000-000000000000"
    L2_cache_size: int = 52_428_800
    is_integrated: int = 0
    is_multi_gpu_board: int = 0


@dataclass
class FakeMemory:
    """Per-process allocated bytes and their peak, as the CUDA caching allocator reports them.

    Nothing allocates here by itself (CPU tensors are not counted); a test calls :meth:`allocate` /
    :meth:`free` (e.g. from a model's forward) to model what a GPU would hold.
    """

    allocated: int = 0
    peak: int = 0
    resets: int = 0

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes


class FakeEvent:
    """``torch.cuda.Event``: CPU wall-clock at ``record()`` (the CPU is synchronous)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self.t: float | None = None

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.t is None or end.t is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end.t - self.t) * 1e3  # milliseconds, as CUDA's


def _is_cuda(d: Any) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return isinstance(d, str) and (d == "cuda" or d.startswith("cuda:"))


def _to_cpu(d: Any) -> Any:
    if _is_cuda(d):
        return torch.device("cpu") if isinstance(d, torch.device) else "cpu"
    return d


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "pin_memory" and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name in ("to", "_to_copy", "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor"):
            args = tuple(_to_cpu(a) for a in args)
        return func(*args, **kwargs)


def _fake_pynvml(props: FakeDeviceProperties, count: int) -> types.ModuleType:
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    state = {"init": 0}

    def need_init() -> None:
        if not state["init"]:
            raise NVMLError("Uninitialized")

    def handle(i: int) -> int:
        need_init()
        if not 0 <= i < count:
            raise NVMLError("Invalid Argument")
        return i

    m.NVMLError = NVMLError
    m.nvmlInit = lambda: state.__setitem__("init", state["init"] + 1)
    m.nvmlShutdown = lambda: state.__setitem__("init", max(0, state["init"] - 1))
    m.nvmlSystemGetDriverVersion = lambda: (need_init(), "550.54.15")[1]
    m.nvmlDeviceGetCount = lambda: (need_init(), count)[1]
    m.nvmlDeviceGetHandleByIndex = handle
    m.nvmlDeviceGetUUID = lambda h: props.uuid[:-1] + str(h)
    m.nvmlDeviceGetCudaComputeCapability = lambda h: (props.major, props.minor)
    m.nvmlDeviceGetName = lambda h: props.name
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=props.total_memory, free=props.total_memory,
                                                                used=0)
    return m


@dataclass
class FakeHostMemory:
    """CUDA's caching host (pinned) allocator, as far as the audit's memory goes: a request takes a block of the
    next power of two (a cached one of that size if there is one); a freed block stays cached, pinned, until
    :meth:`empty_cache` (``torch.accelerator.empty_host_cache``)."""

    active: int = 0
    peak: int = 0
    cached: list[int] = field(default_factory=list)

    @property
    def cached_bytes(self) -> int:
        return sum(self.cached)

    def allocate(self, t: torch.Tensor) -> torch.Tensor:
        import weakref

        n = t.numel() * t.element_size()
        size = 1 << max(0, (n - 1).bit_length())
        if size in self.cached:
            self.cached.remove(size)
        self.active += size
        self.peak = max(self.peak, self.active)
        weakref.finalize(t, self._free, size)
        return t

    def _free(self, size: int) -> None:
        self.active -= size
        self.cached.append(size)

    def empty_cache(self) -> None:
        self.cached.clear()

    def stats(self) -> dict[str, int]:
        """The fields of ``torch.cuda.host_memory_stats()`` the tests read."""
        return {"allocated_bytes.current": self.active + self.cached_bytes, "active_bytes.current": self.active}


class _PinnedAndDropout(TorchFunctionMode):
    """``pin_memory=True`` allocations go to :class:`FakeHostMemory`; with ``cuda_dropout``, ``F.dropout`` in
    training runs ``native_dropout``, as CUDA's ``dropout`` does (the CPU's draws a ``bernoulli_`` mask instead)."""

    def __init__(self, fake: FakeCuda) -> None:
        super().__init__()
        self.fake = fake

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
            return self.fake.host.allocate(func(*args, **kwargs))
        if self.fake.cuda_dropout and func is torch.nn.functional.dropout:
            x = args[0]
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            inplace = kwargs.get("inplace", args[3] if len(args) > 3 else False)
            if training and 0 < p < 1 and not inplace:
                return torch.native_dropout(x, p, True)[0]
        return func(*args, **kwargs)


class _DtypeDependentDropout(TorchDispatchMode):
    """``native_dropout`` whose mask depends on the input's dtype at the same generator state, as CUDA's: a
    16-bit input's mask is drawn after 4 more numbers than an fp32 input's (CUDA's vectorised kernel gives each
    element another RNG offset per dtype)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.native_dropout.default and args[2] is not False and args[0].dtype != torch.float32:
            torch.rand(4, device=args[0].device)
        return func(*args, **kwargs)


@dataclass
class FakeCuda:
    """Context manager installing the fake device (see the module docstring); ``device_count`` GPUs alike."""

    device_count: int = 1
    props: FakeDeviceProperties = field(default_factory=FakeDeviceProperties)
    #: per device index, when the GPUs differ (``props`` for an index not listed); see :meth:`_enter_devices`
    device_props: tuple[FakeDeviceProperties, ...] = ()
    memory: FakeMemory = field(default_factory=FakeMemory)
    synchronize_calls: int = 0
    events_created: int = 0
    cuda_dropout: bool = False  # F.dropout as CUDA's: native_dropout, masks depending on the dtype (module doc)
    host: FakeHostMemory = field(default_factory=FakeHostMemory)

    def __post_init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []
        self._host_modes: list[Any] = []
        self._rng: dict[int, torch.Tensor] = {}
        self._mode: _CudaToCpu | None = None
        self._policy: Any = None
        self._seed_all(0)
        self.current = 0  # the current device (torch.cuda.set_device / torch.cuda.device)
        self._fake_nvml: types.ModuleType | None = None

    # -- torch.cuda replacements ----------------------------------------------------------------------
    def _index(self, device: Any = None) -> int:
        if device is None:
            return self.current
        if isinstance(device, int):
            i = device
        else:
            d = torch.device(device) if isinstance(device, str) else device
            i = d.index if d.index is not None else self.current
        if not 0 <= i < self.device_count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {i}")
        return i

    def _seed_all(self, seed: int) -> None:
        self._rng = {i: self._state(seed, 0) for i in range(self.device_count)}

    @staticmethod
    def _state(seed: int, offset: int) -> torch.Tensor:
        # CUDA's generator state is (seed, philox offset) as 16 bytes
        return torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8).clone()

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name, _MISSING)))
        setattr(owner, name, value)

    def __enter__(self) -> FakeCuda:
        from precision_audit.capture.emulation import CudaAutocastPolicy

        c = torch.cuda
        props = self.props
        fake = self

        def synchronize(device: Any = None) -> None:
            fake._index(device)
            fake.synchronize_calls += 1

        class Event(FakeEvent):
            def __init__(self, *a: Any, **kw: Any) -> None:
                super().__init__(*a, **kw)
                fake.events_created += 1

        def get_rng_state(device: Any = "cuda") -> torch.Tensor:
            return fake._rng[fake._index(device)].clone()

        def set_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
            fake._rng[fake._index(device)] = state.clone()

        def manual_seed(seed: int) -> None:
            fake._rng[0] = fake._state(int(seed), 0)

        patches = {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "_lazy_init": lambda: None,
            "device_count": lambda: fake.device_count,
            "current_device": lambda: 0,
            "set_device": lambda d: fake._index(d),
            "get_device_properties": lambda d=None: (fake._index(d), props)[1],
            "get_device_name": lambda d=None: (fake._index(d), props.name)[1],
            "get_device_capability": lambda d=None: (fake._index(d), (props.major, props.minor))[1],
            "is_bf16_supported": lambda including_emulation=True: props.major >= 8,
            "synchronize": synchronize,
            "Event": Event,
            "get_rng_state": get_rng_state,
            "set_rng_state": set_rng_state,
            "get_rng_state_all": lambda: [get_rng_state(i) for i in range(fake.device_count)],
            "set_rng_state_all": lambda states: [set_rng_state(s, i) for i, s in enumerate(states)],
            "manual_seed": manual_seed,
            "manual_seed_all": lambda seed: fake._seed_all(int(seed)),
            "memory_allocated": lambda d=None: (fake._index(d), fake.memory.allocated)[1],
            "max_memory_allocated": lambda d=None: (fake._index(d), fake.memory.peak)[1],
            "memory_reserved": lambda d=None: (fake._index(d), fake.memory.peak)[1],
            "max_memory_reserved": lambda d=None: (fake._index(d), fake.memory.peak)[1],
            "reset_peak_memory_stats": lambda d=None: fake._reset_peak(d),
            "empty_cache": lambda: None,
            "mem_get_info": lambda d=None: (props.total_memory - fake.memory.allocated, props.total_memory),
            # the optimizers ask when torch is a CUDA build (no graph is ever captured here); without this, a CUDA
            # wheel on a machine without a driver fails in optimizer.step()
            "is_current_stream_capturing": lambda: False,
        }
        for name, value in patches.items():
            self._patch(c, name, value)
        self._enter_devices()

        real_autocast = torch.amp.autocast_mode.autocast

        class autocast(real_autocast):  # noqa: N801 - torch's spelling
            """``torch.autocast("cuda", ...)`` routed to the emulation of CUDA autocast on the CPU."""

            def __init__(self, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                         cache_enabled: bool | None = None) -> None:
                if device_type == "cuda":
                    device_type, dtype = "cpu", dtype or torch.float16  # CUDA autocast's default dtype
                super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

        real_enabled, real_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype

        def is_autocast_enabled(device_type: str | None = None) -> bool:
            return real_enabled("cpu" if device_type in (None, "cuda") else device_type)

        def get_autocast_dtype(device_type: str) -> torch.dtype:
            return real_dtype("cpu" if device_type == "cuda" else device_type)

        self._patch(torch, "autocast", autocast)
        self._patch(torch.amp, "autocast", autocast)
        self._patch(torch, "is_autocast_enabled", is_autocast_enabled)
        self._patch(torch, "get_autocast_dtype", get_autocast_dtype)
        # Kineto has no CUDA here: a profiler asked for CUDA activity records the CPU side only
        real_profile_init = torch.profiler.profile.__init__

        def profile_init(prof_self: Any, *a: Any, activities: Any = None, **kw: Any) -> None:
            if activities is not None:
                activities = [x for x in activities if x != torch.profiler.ProfilerActivity.CUDA]
            real_profile_init(prof_self, *a, activities=activities, **kw)

        self._patch(torch.profiler.profile, "__init__", profile_init)
        self._saved.append((sys.modules, "pynvml", sys.modules.get("pynvml", _MISSING)))
        sys.modules["pynvml"] = self._fake_nvml or _fake_pynvml(props, self.device_count)
        self._policy = CudaAutocastPolicy()
        self._policy.__enter__()
        self._mode = _CudaToCpu()
        self._mode.__enter__()
        self._enter_host_and_dropout()
        return self

    def _enter_host_and_dropout(self) -> None:
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None:
            self._patch(accelerator, "empty_host_cache", self.host.empty_cache)
        self._patch(torch.cuda, "host_memory_stats", self.host.stats)
        self._host_modes = [_PinnedAndDropout(self)] + ([_DtypeDependentDropout()] if self.cuda_dropout else [])
        for m in self._host_modes:
            m.__enter__()

    def _props_of(self, i: int) -> FakeDeviceProperties:
        return self.device_props[i] if i < len(self.device_props) else self.props

    def _enter_devices(self) -> None:
        """Several GPUs, each its own (``device_props``), and a current device: ``set_device``, the
        ``torch.cuda.device(i)`` context, ``current_device``; a device argument of ``None`` or plain ``"cuda"`` is
        the current one, as in torch. Tensors stay CPU tensors whatever their index."""
        c, fake = torch.cuda, self

        class device:  # noqa: N801 - torch's spelling
            def __init__(self, d: Any) -> None:
                self.idx = -1 if d is None else (d if isinstance(d, int) else torch.device(d).index)
                self.idx = -1 if self.idx is None else self.idx

            def __enter__(self) -> None:
                self.prev = fake.current
                if self.idx >= 0:
                    fake.current = fake._index(self.idx)

            def __exit__(self, *exc: Any) -> None:
                fake.current = self.prev

        def manual_seed(seed: int) -> None:  # the current device's generator, as torch.cuda.manual_seed
            fake._rng[fake.current] = fake._state(int(seed), 0)

        patches = {
            "device": device,
            "current_device": lambda: fake.current,
            "set_device": lambda d: setattr(fake, "current", fake._index(d)),
            "get_device_properties": lambda d=None: fake._props_of(fake._index(d)),
            "get_device_name": lambda d=None: fake._props_of(fake._index(d)).name,
            "get_device_capability": lambda d=None: (lambda p: (p.major, p.minor))(fake._props_of(fake._index(d))),
            "manual_seed": manual_seed,
        }
        for name, value in patches.items():
            self._patch(c, name, value)
        if self.device_props:  # NVML names each device as torch does
            nvml = _fake_pynvml(self.props, self.device_count)
            nvml.nvmlDeviceGetName = lambda h: fake._props_of(h).name
            nvml.nvmlDeviceGetCudaComputeCapability = lambda h: (fake._props_of(h).major, fake._props_of(h).minor)
            nvml.nvmlDeviceGetUUID = lambda h: fake._props_of(h).uuid[:-1] + str(h)
            self._fake_nvml = nvml

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """The real torch inside (e.g. to run an emulated audit to compare with), the fake again after."""
        self.__exit__(None, None, None)
        try:
            yield
        finally:
            self.__enter__()

    def __deepcopy__(self, memo: dict) -> FakeCuda:
        return self  # the device itself: a model holding it (to drive its memory) is copied without it

    def _reset_peak(self, device: Any = None) -> None:
        self._index(device)
        self.memory.peak = self.memory.allocated
        self.memory.resets += 1

    def __exit__(self, *exc: Any) -> None:
        for m in reversed(self._host_modes):
            m.__exit__(*exc)
        self._host_modes = []
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        if self._policy is not None:
            self._policy.__exit__(*exc)
            self._policy = None
        for owner, name, value in reversed(self._saved):
            if owner is sys.modules:
                if value is _MISSING:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = value
            elif value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._saved.clear()


@pytest.fixture
def fake_cuda():
    """A :class:`FakeCuda` installed for one test (see the module docstring for what it does not check)."""
    with FakeCuda() as fake:
        yield fake


_AUDITS: dict[tuple, dict] = {}


def fake_cuda_audit(name: str, **options: Any) -> dict:
    """audit.json of a sample model audited in cuda mode under a fresh :class:`FakeCuda` (``--device cuda``),
    computed once per (sample, options) per test session and shared by the test modules that ask for it."""
    import json
    import tempfile
    from pathlib import Path

    from precision_audit.audit import AuditOptions, run_audit

    key = (name, tuple(sorted(options.items())))
    if key not in _AUDITS:
        root = Path(__file__).resolve().parent.parent / "sample_models" / name
        out = Path(tempfile.mkdtemp(prefix=f"fake-cuda-{name}-")) / "out"
        with FakeCuda():
            batch = root / "sample.pt"  # else the model file's sample_batch()
            run_audit(AuditOptions(model=str(root / "model.py"), batch=str(batch) if batch.exists() else None, out=out,
                                   **{"device": "cuda", "steps": 1, **options}))
        _AUDITS[key] = json.loads((out / "audit.json").read_text())
        _AUDITS[key]["_out"] = str(out)
    return _AUDITS[key]


REAL_CUDA = torch.cuda.is_available()  # read when this module is imported, before any test fakes it


@dataclass
class GpuBackend:
    """What a tests/gpu test runs on: ``kind`` "fake" (``fake`` is the device) or "real"."""

    kind: str
    fake: FakeCuda | None = None

    @property
    def real(self) -> bool:
        return self.kind == "real"


@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.gpu)])
def gpu(request):
    """Runs a tests/gpu test twice: on the fake device (the code paths, in every CI run) and on a real GPU
    (``gpu`` marker; skipped without one: the numbers)."""
    if request.param == "real":
        if not REAL_CUDA:
            pytest.skip("needs a CUDA GPU")
        yield GpuBackend("real")
    else:
        with FakeCuda() as fake:
            yield GpuBackend("fake", fake)
