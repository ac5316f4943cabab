"""The cuda-mode path a GPU user runs first, exercised on the CPU under the fake device (tests/fakecuda.py).

These tests check plumbing (which API is called, what is saved and restored, what propagates, what is
measured on which basis), not GPU numerics: tests/gpu does that on a real GPU.
"""

from __future__ import annotations

import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precision_audit as pa
from conftest import SAMPLES
from fakecuda import FakeCuda, fake_cuda  # noqa: F401 - the fixture
from models import DtypeDependentDraws
from precision_audit.capture import CaptureConfig, CaptureSession
from precision_audit.formats import Format
from precision_audit.model_names import fingerprint, model_layout
from precision_audit.policy.schema import LossScaling, ModuleOverride, Policy
from precision_audit.tf32_switches import restore, snapshot, tf32_enabled, tf32_switches

# -- helpers ----------------------------------------------------------------------------------------------

@pytest.fixture
def tf32_state():
    """Puts the process's TF32 settings back after a test that sets them (both APIs)."""
    saved = snapshot()
    yield
    restore(saved)
    assert snapshot() == saved


def make_policy(model: nn.Module, default: str, overrides: dict[str, str] | None = None, **kw) -> Policy:
    fp, n = fingerprint(model)
    return Policy(model_class=type(model).__name__, model_fingerprint=fp, model_modules=n, target_name="test",
                  target_compute_capability=None, default_format=default,
                  modules={k: ModuleOverride(v, "test") for k, v in (overrides or {}).items()},
                  loss_scaling=LossScaling(), model_layout=model_layout(model), **kw)


class Mlp(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def session(model, x, formats=(Format.BF16,), **kw):
    return CaptureSession(model, lambda m: m(x), lambda out: out.float().pow(2).mean(),
                          CaptureConfig(formats=formats, device="cuda", mode="cuda", **kw))


# The user's TF32 settings, through either API (a program uses one of them).
USER_SETTINGS = {
    "default": lambda: None,
    "legacy-medium": lambda: torch.set_float32_matmul_precision("medium"),
    "legacy-high": lambda: torch.set_float32_matmul_precision("high"),
    "legacy-cudnn-off": lambda: setattr(torch.backends.cudnn, "allow_tf32", False),
    "new-matmul-tf32": lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),
    "new-global-tf32": lambda: setattr(torch.backends, "fp32_precision", "tf32"),
    "new-conv-ieee": lambda: setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee"),
}


# -- TF32 switches ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("user", USER_SETTINGS)
@pytest.mark.parametrize("inside", [(False, False), (True, True), (True, False)])
def test_tf32_switches_set_inside_and_restore_the_exact_user_setting(user, inside, tf32_state):
    USER_SETTINGS[user]()
    before = snapshot()
    with tf32_switches(*inside):
        assert tf32_enabled() == inside
    assert snapshot() == before
    if user == "legacy-medium":
        assert torch.get_float32_matmul_precision() == "medium"  # not turned into "high"


def test_the_legacy_flag_read_raises_once_the_new_api_is_set(tf32_state):
    """The torch behaviour the switches work around (if this stops raising, the workaround is still right)."""
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    with pytest.raises(RuntimeError, match="legacy and new APIs"):
        torch.backends.cuda.matmul.allow_tf32  # noqa: B018


@pytest.mark.parametrize("user", ["legacy-medium", "new-matmul-tf32", "new-global-tf32"])
def test_cuda_reference_pass_under_the_users_tf32_setting(user, fake_cuda, tf32_state):
    """The FP32 reference runs with TF32 off for cuBLAS and cuDNN, does not fail on the newer API, and
    leaves the user's exact setting in place."""
    USER_SETTINGS[user]()
    before = snapshot()
    model = Mlp()
    seen = []
    model.a.register_forward_pre_hook(lambda m, a: seen.append(tf32_enabled()))
    with session(model, torch.randn(8, 16, device="cuda")) as s:
        s.reference_run()
        s.format_run(Format.BF16)
    assert seen[0] == (False, False)
    assert snapshot() == before


@pytest.mark.parametrize("user", ["legacy-medium", "new-matmul-tf32"])
def test_runtime_tf32_modules_and_autocast_keep_the_users_setting(user, tf32_state):
    USER_SETTINGS[user]()
    before = snapshot()
    model = nn.Sequential(nn.Linear(16, 16), nn.Sequential(nn.Linear(16, 4)))
    seen = []  # a child's pre-hook runs inside its parent's (wrapped) forward
    model[1][0].register_forward_pre_hook(lambda m, a: seen.append(tf32_enabled()))
    policy = make_policy(model, "bf16", {"1": "fp32"}, tf32_matmul=True, tf32_cudnn=False)
    with pa.apply_policy(model, policy, device_type="cuda"):
        model(torch.randn(2, 16))
    with pa.autocast(policy, "cpu"):
        inside = tf32_enabled()
    assert seen == [(False, False)] and inside == (True, False)
    assert snapshot() == before


def test_verify_fp32_arm_runs_strict_fp32_on_cuda(fake_cuda, tf32_state):
    from precision_audit.verify import VerifyOptions, run_verify

    torch.backends.cudnn.allow_tf32 = True  # torch's default: cuDNN convolutions may use TF32
    torch.backends.cuda.matmul.allow_tf32 = True
    model = Mlp()
    seen: list[tuple[bool, bool]] = []
    model.a.register_forward_pre_hook(lambda m, a: seen.append(tf32_enabled()))
    x = torch.randn(8, 16, device="cuda")
    out = run_verify(model, lambda m: m(x), lambda y: y.float().pow(2).mean(), make_policy(model, "bf16"),
                     "cuda", "cuda", VerifyOptions(steps=1))
    assert not out.errors, out.errors
    assert seen[0] == (False, False)  # the fp32 arm: neither cuBLAS nor cuDNN TF32
    assert seen[1] == (True, True)  # the other arms: as the user set them
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)


# -- RNG: every device's state is restored ------------------------------------------------------------------

def test_every_gpus_rng_state_is_restored():
    with FakeCuda(device_count=2):
        states = [torch.tensor([11 + i, 7], dtype=torch.int64).view(torch.uint8) for i in range(2)]
        for i, st in enumerate(states):
            torch.cuda.set_rng_state(st, i)
        model, x = Mlp(), torch.randn(8, 16, device="cuda")
        cpu = torch.get_rng_state()
        with session(model, x, seed=3) as s:
            s.reference_run()
            s.format_run(Format.BF16)
        for i, st in enumerate(states):
            assert torch.equal(torch.cuda.get_rng_state(i), st), f"device {i}'s RNG state was not restored"
        assert torch.equal(torch.get_rng_state(), cpu)


def test_verify_restores_every_gpus_rng_state():
    from precision_audit.verify import VerifyOptions, run_verify

    with FakeCuda(device_count=2):
        st = torch.tensor([5, 9], dtype=torch.int64).view(torch.uint8)
        torch.cuda.set_rng_state(st, 1)
        model = Mlp()
        x = torch.randn(4, 16, device="cuda")
        run_verify(model, lambda m: m(x), lambda y: y.float().pow(2).mean(), make_policy(model, "bf16"),
                   "cuda", "cuda", VerifyOptions(steps=1))
        assert torch.equal(torch.cuda.get_rng_state(1), st)


# -- out of memory propagates ---------------------------------------------------------------------------------

class OomUnderAutocast(nn.Module):
    """Runs out of memory whenever it runs under (cuda) autocast, or when ``always`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) / 4)
        self.always = False

    def forward(self, x):
        if self.always or torch.is_autocast_enabled("cuda"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return F.linear(x, self.weight)  # computes itself: it is re-run alone per format


def test_oom_in_a_local_rerun_propagates(fake_cuda):
    model = nn.Sequential(nn.Linear(16, 16), OomUnderAutocast())
    with session(model, torch.randn(4, 16, device="cuda")) as s, pytest.raises(torch.OutOfMemoryError):
        s.reference_run()


def test_oom_in_the_plan_verification_is_not_a_broken_plan(fake_cuda):
    model = nn.Sequential(nn.Linear(16, 16), OomUnderAutocast())
    model[1].always = False
    with session(model, torch.randn(4, 16, device="cuda"), formats=()) as s:
        s.reference_run()
        s.model[1].always = True
        with pytest.raises(torch.OutOfMemoryError):
            s.verify_plan(make_policy(model, "bf16"), Format.BF16)


# -- memory: weight copies and peak figures ------------------------------------------------------------------

def test_a_saved_transposed_weight_cast_is_a_weight_copy():
    """CUDA autocast's linear: the weight is cast (ToCopyBackward0) and the GEMM saves its transpose
    (TBackward0); that is a weight copy, as the emulation counts it, not an activation."""
    from precision_audit.capture.memory import SavedTensorCounter

    lin = nn.Linear(8, 4)
    x = torch.randn(2, 8, dtype=torch.float16, requires_grad=True)  # an activation: mm saves the weight
    counter = SavedTensorCounter(lin, lambda: None)
    with counter:
        w16 = lin.weight.to(torch.float16)
        y = torch.mm(x, w16.t())
        y = y + torch.mm(x, w16.t().contiguous())  # a copy of the cast, not a view: an activation
    assert counter.tally.weight_copy_bytes == 4 * 8 * 2
    assert counter.tally.activation_bytes == x.numel() * 2 + 4 * 8 * 2  # x, and the contiguous copy (no view)


class Allocating(nn.Module):
    """Models what a GPU allocates during its forward (4 bytes an element in fp32, 2 under autocast),
    and records what instruments it ran under."""

    def __init__(self, fake: FakeCuda) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.fake = fake
        self.seen: list[tuple[bool, int]] = []

    def forward(self, x):
        y = self.lin(x)
        nbytes = 1000 * y.element_size()
        self.fake.memory.allocate(nbytes)
        self.fake.memory.free(nbytes)
        self.seen.append((torch.autograd.profiler._is_profiler_enabled,
                          len(self._forward_pre_hooks) + len(self._forward_hooks) + len(self.lin._forward_hooks)))
        return y


def test_peak_memory_is_per_step_above_the_baseline(fake_cuda):
    model = Allocating(fake_cuda)
    fake_cuda.memory.allocate(2**30)  # parameters, batch and what the session keeps: the baseline
    with session(model, torch.randn(4, 16, device="cuda")) as s:
        s.reference_run()
        s.format_run(Format.BF16)
        s.timed_steps(2, traces=False)
        mem = s.result().memory
    assert mem["fp32"]["peak_bytes"] == 4000
    assert mem["bf16"]["peak_bytes"] == 2000


def test_timed_steps_are_clean(fake_cuda):
    """The step times come from steps with no profiler, no module hooks and no per-module CUDA events (a pair of
    events around the whole step); without traces asked for, no step runs under the profiler."""
    model = Allocating(fake_cuda)
    with session(model, torch.randn(4, 16, device="cuda")) as s:
        s.reference_run()
        s.format_run(Format.BF16)
        s.seen_before = len(s.model.seen)
        events = fake_cuda.events_created
        s.timed_steps(2, traces=False)
        seen = s.model.seen[s.seen_before:]
        assert len(s.step_times["fp32"]) == 2 and len(s.step_times["bf16"]) == 2
    instrumented = [x for x in seen if x[1] > 0]
    clean = [x for x in seen if x == (False, 0)]
    assert len(instrumented) == 2 * 2  # 2 instrumented steps per format (the clean ones warmed up)
    assert not any(on for on, _ in instrumented)  # no profiler without traces asked for
    assert len(clean) == 2 * 3  # warm-up + 2 clean steps per format, nothing attached
    # per format: 2 instrumented steps x 2 modules x 2 events, and 2 events around each of the 2 timed clean steps
    assert fake_cuda.events_created - events == 2 * (2 * 2 * 2 + 2 * 2)


def test_peak_memory_not_measured_without_timed_steps(fake_cuda):
    from precision_audit.analysis.performance import _memory

    model = Allocating(fake_cuda)
    with session(model, torch.randn(4, 16, device="cuda")) as s:
        s.reference_run()
        s.format_run(Format.BF16)
        res = s.result()
    mem = _memory(res, 0, 0)
    assert mem.per_format["bf16"].peak_gpu_bytes is None
    assert mem.per_format["bf16"].peak_note.startswith("not measured: no clean timed step")


# -- dropout: the same masks in every pass on CUDA ---------------------------------------------------------------

class AttentionWithDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], 8, 3, 2, 16).permute(2, 0, 3, 1, 4)
        torch.rand(64 if q.dtype == torch.float32 else 16, device=q.device)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5 if self.training else 0.0).sum(1)


@pytest.mark.parametrize("make", [DtypeDependentDraws, AttentionWithDropout])
def test_cuda_passes_see_the_reference_dropout_masks(make, fake_cuda):
    model = make().train()
    x = torch.randn(4, 8, 32, device="cuda") if make is AttentionWithDropout else torch.randn(16, 32, device="cuda")
    with session(model, x, formats=(Format.BF16,)) as s:
        s.reference_run()
        s.format_run(Format.BF16)
        res = s.result()
    # the dtype-dependent extra draw itself cannot be replayed (other shape): drawn anew, and said so
    assert any("random draw(s)" in w for w in res.warnings)
    root = next(L for L in res.layers if L.name == "")
    err = root.formats[Format.BF16].accumulated.rel_l2
    # bf16 rounding alone: about 1e-2; a different mask on half the elements: order 1
    assert err < 0.05, f"output rel. error {err:.3f}: the masks differ between the FP32 and the bf16 pass"
    for L in res.layers:
        fs = L.formats.get(Format.BF16)
        if fs is not None and fs.local is not None:
            assert fs.local.rel_l2 < 0.05, (L.name, fs.local.rel_l2)


# -- GEMM timings -------------------------------------------------------------------------------------------

class Misaligned(nn.Module):
    """A misaligned convolution (C_in 3 -> C_out 12) and the same misaligned linear layer called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 12, 3, padding=1)
        self.fc1 = nn.Linear(12, 20)
        self.fc2 = nn.Linear(12, 20)

    def forward(self, x):
        h = self.conv(x).mean((2, 3))
        return self.fc1(h) + self.fc2(h)  # one GEMM shape, twice


@pytest.fixture(scope="module")
def gemm_audit():
    """One capture of Misaligned under the fake GPU (an H100), planned for an A100, its GEMMs timed."""
    with FakeCuda() as fake:
        yield _gemm_audit(fake, target="a100")


def _gemm_audit(fake, target):
    from precision_audit.analysis import gemm_bench
    from precision_audit.analysis.performance import performance
    from precision_audit.gpus import resolve_target

    calls: list[tuple] = []
    real_gemm, real_conv = gemm_bench.time_gemm, gemm_bench.time_conv
    gemm_bench.time_gemm = lambda *a, **k: (calls.append(("bmm", *a[:4])), real_gemm(*a, **k))[1]
    gemm_bench.time_conv = lambda spec, *a, **k: (calls.append(("conv", spec)), real_conv(spec, *a, **k))[1]
    try:
        model = Misaligned()
        with session(model, torch.randn(2, 3, 8, 8, device="cuda")) as s:
            s.reference_run()
            s.format_run(Format.BF16)
            cap = s.result()
        tgt = resolve_target(target)
        perf = performance(cap, tgt, {}, 0, 0)
        gemm_bench.measure_gemms(cap, perf, tgt, "cuda", (Format.BF16,))
    finally:
        gemm_bench.time_gemm, gemm_bench.time_conv = real_gemm, real_conv
    return perf, calls


def test_a_convolution_is_timed_as_a_convolution_with_padded_channels(gemm_audit):
    perf, calls = gemm_audit
    conv = next(f for f in perf.layers["conv"].alignment if f["kind"] == "conv")
    as_is, padded = conv["measured"]["as_is"]["timed_as"], conv["measured"]["padded"]["timed_as"]
    assert as_is == {"op": "convolution", "input": [2, 3, 8, 8], "weight": [12, 3, 3, 3], "stride": [1, 1],
                     "padding": [1, 1], "groups": 1}
    assert padded["input"] == [2, 8, 8, 8] and padded["weight"] == [16, 8, 3, 3]  # channels to 8, not K = 27
    assert [c[0] for c in calls].count("conv") == 2


def test_identical_gemms_are_timed_once(gemm_audit):
    perf, calls = gemm_audit
    bmm = [c for c in calls if c[0] == "bmm"]
    assert len(bmm) == len(set(bmm)), f"a GEMM shape was timed more than once: {bmm}"
    # fc1 and fc2 share their shape: both findings carry the one timing
    t1 = next(f for f in perf.layers["fc1"].alignment if f.get("measured"))["measured"]["as_is"]["measured_s"]
    t2 = next(f for f in perf.layers["fc2"].alignment if f.get("measured"))["measured"]["as_is"]["measured_s"]
    assert t1 == t2


def test_the_tensor_core_verdict_uses_the_measured_gpus_peak(gemm_audit):
    from precision_audit.gpus import resolve_target

    perf, _ = gemm_audit  # planned for an A100, measured on the (fake) H100
    rec = next(f for f in perf.layers["fc1"].alignment if f.get("measured"))["measured"]["as_is"]
    h100 = resolve_target("h100").peak("fp32")
    assert rec["judged_against"] == f"NVIDIA H100 80GB HBM3 (measured): FP32 non-Tensor-Core peak {h100:g} TFLOP/s"
    assert h100 != resolve_target("a100").peak("fp32")


def test_no_tensor_core_verdict_for_a_gpu_not_in_the_table():
    from fakecuda import FakeDeviceProperties
    from precision_audit.analysis.gemm_bench import GemmTimer
    from precision_audit.capture.ops import GemmOp

    with FakeCuda(props=FakeDeviceProperties(name="Some Future GPU", major=12, minor=0)):
        rec = GemmTimer("cuda").measure(GemmOp("mm", "matmul", 8, 8, 8, 1, 1024, ()), torch.float16)
    assert rec["tensor_cores"] is None and rec["judged_against"].startswith("not judged: Some Future GPU")


# -- a full cuda-mode audit of every sample model -------------------------------------------------------------

@pytest.mark.parametrize("name", SAMPLES)
def test_a_cuda_mode_audit_of_every_sample_runs_to_the_end(name):
    """What a GPU user runs first (``precision-audit MODEL --device cuda``), on the fake device: the audit
    completes, and every figure that only a GPU run produces is there and says where it came from."""
    from pathlib import Path

    from fakecuda import fake_cuda_audit
    from precision_audit.record.schemas import validate_audit

    a = fake_cuda_audit(name, target="h100")  # shared with tests/gpu/test_cuda_vs_emulated.py
    out = Path(a.pop("_out"))
    try:
        validate_audit(a)
    finally:
        a["_out"] = str(out)
    assert a["mode"] == "cuda" and a["device"] == "cuda" and a["emulation"] is None
    hw = a["hardware"]
    assert hw["cuda_available"] and hw["nvml_status"] == "ok"
    assert [g["name"] for g in hw["gpus"]] == ["NVIDIA H100 80GB HBM3"] and hw["gpus"][0]["source"] == "nvml+torch"
    for fmt in ("fp32", *a["formats"]):
        st = a["summary"][fmt]["step_time"]
        assert st["measured_s"] > 0 and st["measured_on"] == "NVIDIA H100 80GB HBM3 (cuda)"
        mem = a["memory"]["per_format"][fmt]
        assert isinstance(mem["peak_gpu_bytes"], int) and mem["peak_note"] is None
    assert a["memory"]["peak_basis"].startswith("peak GPU allocation of one clean")
    # timed with CUDA events, no profiler trace unless asked for (--trace), and tb/ says so
    assert a["traces"]["files"] == [] and a["traces"]["note"].startswith("no profiler trace taken: the timed steps "
                                                                         "were timed with CUDA events")
    assert (out / "tb" / "NO_PROFILER_TRACE.txt").read_text().startswith("No profiler trace in this audit")
    assert (out / "report.html").is_file() and (out / "policy.json").is_file()
    assert a["plan"]["verification"] is not None and a["plan"]["verification"]["error"] is None
    assert not any("not measured: RuntimeError" in w for w in a["warnings"]), a["warnings"]


# -- the fake device itself ------------------------------------------------------------------------------------

def test_the_fake_device_fakes_what_the_audit_calls_and_leaves_nothing_behind():
    real = (torch.cuda.is_available(), torch.autocast, torch.is_autocast_enabled, sys.modules.get("pynvml"))
    with FakeCuda(device_count=2) as fake:
        assert torch.cuda.is_available() and torch.cuda.device_count() == 2
        assert torch.cuda.get_device_properties(1).name == "NVIDIA H100 80GB HBM3"
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.cuda.get_device_properties(2)
        x = torch.ones(3, device="cuda")
        y = torch.zeros(2).to("cuda:1")
        assert x.device.type == "cpu" and y.device.type == "cpu" and torch.randn(2).cuda().device.type == "cpu"
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
            # routed to the emulation of CUDA autocast: layer_norm runs in fp32 as on CUDA (not as CPU autocast)
            assert nn.functional.layer_norm(x.bfloat16(), (3,)).dtype == torch.float32
            assert (x @ x.view(3, 1)).dtype == torch.bfloat16
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        time.sleep(0.01)
        e.record()
        assert 5 < s.elapsed_time(e) < 1000
        torch.cuda.manual_seed_all(7)
        assert torch.equal(torch.cuda.get_rng_state(0), torch.cuda.get_rng_state(1))
        fake.memory.allocate(100)
        torch.cuda.reset_peak_memory_stats()
        fake.memory.allocate(50)
        fake.memory.free(50)
        assert (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()) == (100, 150)
        import pynvml

        pynvml.nvmlInit()
        assert pynvml.nvmlDeviceGetCount() == 2
        assert pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)) == "NVIDIA H100 80GB HBM3"
        pynvml.nvmlShutdown()
    assert (torch.cuda.is_available(), torch.autocast, torch.is_autocast_enabled, sys.modules.get("pynvml")) == real
    assert torch.ones(1, device="cpu").device.type == "cpu"
    if not real[0]:
        with pytest.raises((RuntimeError, AssertionError)):
            torch.ones(1, device="cuda")
