"""The compiled (C++) emulation kernels (emulation/compiled.py, emulation/_emulation_kernels.cpp).

They must be a pure speed-up: for every op of the autocast table, the compiled kernels give the same values
(bit for bit, NaNs included), the same dtypes and the same gradients as the Python kernels, and whole audits
give the same numbers. Also: the registrations come off again, the memory counter still recognises rounded
copies, and the command line says clearly when the kernels are missing or cannot be built.

The library is built once for this module into a temporary cache (about 15 s on 2 cores); the module is
skipped, with the reason, where there is no C++ compiler or ninja.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from precision_audit.capture.memory import SavedTensorCounter
from precision_audit.capture.stats import python_statistics
from precision_audit.emulation import autocast as emulation
from precision_audit.emulation import compiled, rounding
from precision_audit.emulation.autocast import CudaAutocastPolicy, LowPrecisionGemmMode, emulated_autocast
from precision_audit.emulation.autocast_policy import CastPolicy
from precision_audit.errors import AuditError
from test_emulation import CASES, Inputs, _dtypes_for  # the op recipes of the dtype-policy tests

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())  # the repository
FP16, BF16 = torch.float16, torch.bfloat16


def _toolchain_missing() -> str | None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler"
    if shutil.which("ninja") is None:
        return "no ninja"
    return None


pytestmark = pytest.mark.skipif(_toolchain_missing() is not None,
                                reason=f"cannot build the compiled kernels: {_toolchain_missing()}")


@pytest.fixture(scope="module")
def kernel_dir(built_kernels):
    """The session's library (built once by conftest's ``built_kernels``), loaded for this module; afterwards this
    process forgets it (later tests use Python)."""
    d, _ = built_kernels
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PRECISION_AUDIT_KERNEL_DIR", str(d))
        path, seconds = compiled.build()
        assert path.is_file() and path.parent.parent == d and seconds == 0.0  # already built: nothing to do
        assert compiled.load() and compiled.is_built() and compiled.is_loaded()
        yield d
    compiled._loaded = None


# -- op by op ---------------------------------------------------------------------------------------------


class _GradInputs(Inputs):
    """The recipes' inputs, floating ones as leaves that require grad (kept, to compare their .grad)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.leaves: list[torch.Tensor] = []

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        t = super()._cast(t).detach().requires_grad_(True)
        self.leaves.append(t)
        return t


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flat(o)]
    return []


def _run(case, low: torch.dtype, kernels: str):
    """(outputs, grads) of a case under the emulation with the given kernels, or ("raises", message)."""
    torch.manual_seed(0)
    inputs = _GradInputs(_dtypes_for(case, low), low)
    mode = LowPrecisionGemmMode() if case.gemm_mode else None
    try:
        with warnings.catch_warnings(), CudaAutocastPolicy(kernels):
            warnings.simplefilter("ignore")
            with emulated_autocast(low, gemm_mode=mode):
                outs = _flat(case.recipe(inputs))
            diff = [o for o in outs if o.requires_grad and o.is_floating_point()]
            if diff:
                torch.stack([o.float().sum() for o in diff]).sum().backward()
    except Exception as e:  # noqa: BLE001 - the outcome itself is compared
        return ("raises", f"{type(e).__name__}: {e}")
    return ([o.detach() for o in outs], [t.grad for t in inputs.leaves])


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        torch.nan_to_num(a, nan=0.0, posinf=1.0, neginf=-1.0), torch.nan_to_num(b, nan=0.0, posinf=1.0, neginf=-1.0)
    ) and torch.equal(a.isnan(), b.isnan())


@pytest.mark.parametrize("low", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_compiled_kernels_equal_python_kernels_forward_and_backward(kernel_dir, case, low) -> None:
    py, cc = _run(case, low, "python"), _run(case, low, "compiled")
    if py[0] == "raises":
        assert cc == py
        return
    (py_out, py_grad), (cc_out, cc_grad) = py, cc
    assert len(py_out) == len(cc_out) and len(py_grad) == len(cc_grad)
    for i, (a, b) in enumerate(zip(py_out, cc_out)):
        assert _same(a, b), f"{case.id}: output {i} differs ({a.dtype} vs {b.dtype})"
    for i, (a, b) in enumerate(zip(py_grad, cc_grad)):
        assert _same(a, b), f"{case.id}: grad of input {i} differs"


def test_the_compiled_kernels_take_the_three_policies_and_nothing_else(kernel_dir) -> None:
    """Every GEMM-family (except einsum), fp32 and fp32-with-dtype op runs in C++; a Python kernel there
    would mean the speed-up is lost, a C++ kernel elsewhere that a policy is implemented twice."""
    policy_obj = CudaAutocastPolicy("compiled")
    split = policy_obj._compiled_split()
    names = {n for v in split.values() for n in v}
    for name, policy in policy_obj.policy.items():
        if emulation._resolve(name) is None:
            continue
        wanted = (policy in (CastPolicy.FP32, CastPolicy.FP32_SET_OPT_DTYPE) or
                  (policy is CastPolicy.LOWER_PRECISION_FP and name in emulation.FP32_COMPUTE_OPS
                   and name != "einsum"))
        assert (name in names) == wanted, name
    assert len(names) > 80


def test_compiled_kernels_are_removed_on_exit_and_cpu_autocast_is_back(kernel_dir) -> None:
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    with CudaAutocastPolicy("compiled"), emulated_autocast(BF16):
        assert F.layer_norm(x.to(BF16), (8,)).dtype == torch.float32  # CUDA's policy: fp32
        assert torch.equal(F.linear(x, w), F.linear(x.to(BF16).float(), w.to(BF16).float()).to(BF16))
    with torch.autocast("cpu", dtype=BF16):
        assert F.layer_norm(x.to(BF16), (8,)).dtype == BF16  # torch's own CPU policy again
    # and the policy can be entered again (the C++ side refuses a second registration while one is active)
    with CudaAutocastPolicy("compiled"), emulated_autocast(BF16):
        assert F.layer_norm(x.to(BF16), (8,)).dtype == torch.float32


@pytest.mark.parametrize("inner_kernels", ["compiled", "python"])
def test_a_policy_nested_in_a_compiled_one_takes_over_and_hands_back(kernel_dir, inner_kernels) -> None:
    """The inner policy is the one installed while it is active (its own kernels), the outer one's are back after
    it; on torch releases before 2.13, whose torch.library refuses a second Python kernel for the same op and key,
    nesting raised "already a kernel registered from python"."""
    x = torch.randn(4, 8)
    with CudaAutocastPolicy("compiled") as outer:
        assert outer._compiled_on
        with CudaAutocastPolicy(inner_kernels) as inner:
            assert not outer._compiled_on and outer._lib is None
            assert inner._compiled_on is (inner_kernels == "compiled")
            with emulated_autocast(FP16):
                assert F.softmax(x.half(), -1).dtype == torch.float32
        assert inner._lib is None and not inner._compiled_on
        assert outer._compiled_on and outer._lib is not None
        with emulated_autocast(FP16):
            assert F.softmax(x.half(), -1).dtype == torch.float32
    assert not rounding._COMPILED_ACTIVE and emulation._ACTIVE == []
    with torch.autocast("cpu", dtype=FP16):  # CPU autocast's own policy once both are gone
        assert F.softmax(x.half(), -1).dtype == FP16


@pytest.mark.parametrize("low", [FP16, BF16], ids=["fp16", "bf16"])
def test_saved_tensor_bytes_are_the_same_with_either_kernels(kernel_dir, low) -> None:
    """The memory counter learns which fp32 tensors hold rounded values from the kernels' registry; the
    compiled kernels hand theirs over, so the tally (2 bytes per rounded activation) is unchanged."""
    from precision_audit.loading import load_batch, load_model

    tallies = []
    for kernels in ("python", "compiled"):
        model, source = load_model(str(ROOT / "sample_models" / "tiny_gpt" / "model.py"))
        batch = load_batch(str(ROOT / "sample_models" / "tiny_gpt" / "sample.pt"), model, source)
        with CudaAutocastPolicy(kernels), SavedTensorCounter(model, lambda: None) as counter:
            with emulated_autocast(low):
                out = model(*batch.args, **batch.kwargs)
        t = counter.tally
        tallies.append((t.activation_bytes, t.weight_copy_bytes, t.tensors))
        del out
    assert tallies[0] == tallies[1]
    assert tallies[0][1] > 0  # the rounded weight copies were recognised as such


# -- whole audits -------------------------------------------------------------------------------------------

_TIMING_KEYS = {"time", "step_time", "timings", "seconds", "step_times_s", "generated", "created", "duration_s",
                "forward_ms", "measured", "kernels", "elapsed_s"}


def _numbers(audit: dict) -> dict:
    """The measured numerics of an audit (layers, summary errors, loss scale, plan), without timings."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in _TIMING_KEYS and "time" not in k}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    return strip({k: audit[k] for k in ("layers", "loss_scale", "plan", "verdict")})


@pytest.mark.parametrize("sample", ["mlp", "tiny_gpt", "fp16_trouble"])
def test_audits_are_identical_with_either_kernels(kernel_dir, tmp_path, sample) -> None:
    """The Python-kernel audit runs in a process that never loaded the library (an empty kernel cache), so
    nothing the library does in-process can make the two sides agree by accident."""
    from precision_audit.audit import AuditOptions, run_audit

    model, batch = ROOT / "sample_models" / sample / "model.py", ROOT / "sample_models" / sample / "sample.pt"
    r = _cli(str(model), "--batch", str(batch), "--out", str(tmp_path / "python"), "--steps", "0", "-q",
             env_dir=tmp_path / "empty-cache")
    assert r.returncode in (0, 1), r.stderr
    # the statistics on the Python path on both sides: the kernels are bit-identical, while the fused statistics
    # sum in another order (tests/capture/test_fused_stats.py compares those against the stored audits)
    with python_statistics():
        run_audit(AuditOptions(model=str(model), batch=str(batch), out=tmp_path / "compiled", steps=0,
                               kernels="compiled"))
    audits = {k: json.loads((tmp_path / k / "audit.json").read_text()) for k in ("python", "compiled")}
    assert audits["python"]["emulation"]["kernels"] == "python"
    assert audits["compiled"]["emulation"]["kernels"] == "compiled"
    assert _numbers(audits["python"]) == _numbers(audits["compiled"])
    assert "Autocast kernels: compiled" in (tmp_path / "compiled" / "report.html").read_text()


def test_dispatch_modes_never_see_the_kernels_control_ops(kernel_dir) -> None:
    """The capture counts the ops a dispatch mode sees as the model's own; the library's enable / drain /
    recording calls must not be among them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    with Log(), CudaAutocastPolicy("compiled"), SavedTensorCounter(model, lambda: None):
        with emulated_autocast(BF16):
            model(torch.randn(2, 8)).float().sum().backward()
    assert seen and not [s for s in seen if "precision_audit_emu" in s]


# -- command line -------------------------------------------------------------------------------------------


def _cli(*args: str, env_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PRECISION_AUDIT_KERNEL_DIR": str(env_dir)}
    return subprocess.run([sys.executable, "-m", "precision_audit", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def test_build_kernels_reports_an_existing_build_and_auto_uses_it(kernel_dir, tmp_path) -> None:
    r = _cli("build-kernels", env_dir=kernel_dir)
    assert r.returncode == 0 and "already built" in r.stdout and str(kernel_dir) in r.stdout
    r = _cli("sample_models/mlp/model.py", "--batch", "sample_models/mlp/sample.pt", "--out", str(tmp_path / "a"),
             "--steps", "0", env_dir=kernel_dir)
    assert r.returncode == 0, r.stderr
    assert "(compiled kernels)" in r.stderr
    assert json.loads((tmp_path / "a" / "audit.json").read_text())["emulation"]["kernels"] == "compiled"


def test_kernels_compiled_without_a_build_is_a_clear_error(tmp_path) -> None:
    empty = tmp_path / "empty-cache"
    r = _cli("sample_models/mlp/model.py", "--batch", "sample_models/mlp/sample.pt", "--out", str(tmp_path / "a"),
             "--kernels", "compiled", env_dir=empty)
    assert r.returncode == 2
    assert "not built" in r.stderr and "precision-audit build-kernels" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "a").exists()
    r = _cli("sample_models/mlp/model.py", "--batch", "sample_models/mlp/sample.pt", "--out", str(tmp_path / "b"),
             "--steps", "0", "--kernels", "auto", env_dir=empty)
    assert r.returncode == 0 and "(python kernels)" in r.stderr


def test_build_without_a_compiler_explains_and_leaves_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PRECISION_AUDIT_KERNEL_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    with pytest.raises(AuditError, match="no C\\+\\+ compiler"):
        compiled.build()
    assert not (tmp_path / "cache").exists()


def test_a_failed_compile_leaves_no_build_behind(tmp_path, monkeypatch) -> None:
    """A source that does not compile: the error carries the compiler's message, and no half-built folder
    remains to be mistaken for a build."""
    bad = tmp_path / "broken.cpp"
    bad.write_text("#include <torch/library.h>\nthis is not C++;\n")
    monkeypatch.setenv("PRECISION_AUDIT_KERNEL_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compiled, "SOURCE", bad)
    monkeypatch.setattr(compiled, "LIBRARY_NAME", "precision_audit_broken")
    with pytest.raises(AuditError, match="building the compiled kernels failed") as e:
        compiled.build()
    assert "error" in str(e.value).lower()
    assert not compiled.is_built()
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_library_that_cannot_be_loaded_falls_back_or_explains(tmp_path, monkeypatch, caplog) -> None:
    """A damaged cache (here: a file that is not a shared library) must not crash an audit: auto falls back to
    the Python kernels with a warning, and --kernels compiled says what to delete."""
    monkeypatch.setenv("PRECISION_AUDIT_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(compiled, "_loaded", None)
    compiled.build_dir().mkdir(parents=True)
    compiled.library_path().write_bytes(b"not an ELF file")
    with caplog.at_level("WARNING"):
        assert compiled.resolve("auto") == "python"
    assert "cannot be loaded" in caplog.text
    with pytest.raises(AuditError, match="cannot be loaded") as e:
        compiled.resolve("compiled")
    assert "build-kernels" in e.value.message


@pytest.mark.parametrize("inner_kernels", ["python", "compiled"])
def test_a_nested_policy_keeps_what_the_outer_compiled_kernels_rounded(kernel_dir, inner_kernels) -> None:
    """The memory counter's registry finds the rounded GEMM operands the outer policy's compiled kernels made, also
    while an inner policy is in force (their records are drained before the kernels are switched off: otherwise
    they counted at fp32 size, found by review)."""
    w, x = torch.randn(8, 8, requires_grad=True), torch.randn(4, 8)
    with CudaAutocastPolicy("compiled"):
        rounding.start_rounding_registry()
        try:
            with emulated_autocast(FP16):
                y = torch.mm(x, w)
            mm = y.grad_fn.next_functions[0][0]
            ptrs = [t.untyped_storage().data_ptr() for t in (mm._saved_self, mm._saved_mat2) if t is not None]
            assert ptrs
            with CudaAutocastPolicy(inner_kernels):
                assert all(rounding.rounded_info(p) is not None for p in ptrs)
            assert all(rounding.rounded_info(p) is not None for p in ptrs)
        finally:
            rounding.stop_rounding_registry()
