"""Issue 31 defects 1 and 7: CUDA ranks get a process group that serves every collective the audit makes, and a
rank that sees one GPU uses it; ``--nproc`` is capped by what the machine runs (issue 32).

NCCL serves CUDA tensors only, and the audit's own checks and reductions run on CPU tensors
(precision_audit/distributed/lockstep.py, reduce.py), so a NCCL-only process group failed every distributed GPU
audit at its first collective. Without a GPU, the same failure is shown by a backend that serves CUDA tensors only
(tests/distributed/fake_nccl_worker.py, under tests/fakecuda.py); the real one runs in
tests/gpu/test_distributed_gpu.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fakecuda import FakeCuda
from precision_audit.cli import main
from precision_audit.errors import OptionError

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
MLP = str(ROOT / "sample_models" / "mlp" / "model.py")


def _pairs(spec: str) -> dict[str, str]:
    """torch's backend string: "gloo" (every device), or "cpu:gloo,cuda:nccl"."""
    if ":" not in spec:
        return {"cpu": spec, "cuda": spec}
    return dict(p.split(":") for p in spec.split(","))


@pytest.mark.parametrize("device", ["cuda:0", "cuda:3", "cpu"])
def test_every_tensor_device_of_the_audit_has_a_backend_that_serves_it(device):
    """The audit's collectives carry CPU tensors (its checks and reductions, object collectives) on every rank,
    and CUDA tensors (the loss, DDP's and FSDP's buckets) on CUDA ranks: NCCL must serve only the CUDA ones."""
    from precision_audit.distributed.run import backend_for

    pairs = _pairs(backend_for(device))
    serves = {"gloo": {"cpu", "cuda"}, "nccl": {"cuda"}}  # torch.distributed's documentation, "Backends"
    needed = {"cpu", "cuda"} if device.startswith("cuda") else {"cpu"}
    for kind in needed:
        assert kind in serves[pairs[kind]], f"{kind} tensors on a {device} rank go to {pairs[kind]}"
    if device.startswith("cuda"):
        assert pairs["cuda"] == "nccl", "CUDA tensors of GPU ranks are NCCL's"


@pytest.mark.parametrize("local,world,count,want", [(0, 2, 2, 0), (1, 2, 2, 1), (1, 2, 8, 1), (1, 2, 1, 0),
                                                   (7, 8, 1, 0), (0, 1, 1, 0)],
                         ids=["own-of-2", "own-of-2b", "own-of-8", "one-visible", "one-visible-rank7", "single"])
def test_a_rank_uses_its_own_gpu_or_the_one_it_sees(local, world, count, want):
    from precision_audit.distributed.run import cuda_index

    assert cuda_index(local, world, count) == want


@pytest.mark.parametrize("local,world,count", [(2, 4, 2), (0, 1, 0)], ids=["more-ranks-than-gpus", "no-gpu"])
def test_a_rank_without_a_gpu_of_its_own_is_refused(local, world, count):
    from precision_audit.distributed.run import cuda_index

    with pytest.raises(OptionError) as e:
        cuda_index(local, world, count)
    assert "GPU" in e.value.message


def test_local_rank_one_seeing_one_gpu_picks_it(monkeypatch):
    """SLURM --gpus-per-task=1: LOCAL_RANK is 1, the rank sees one device (index 0). set_device(LOCAL_RANK) raised
    'invalid device ordinal' there."""
    from precision_audit.distributed.run import _device

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    opts = SimpleNamespace(device="cuda", emulate=False)
    with FakeCuda(device_count=1):
        assert _device(opts) == "cuda:0"
    with FakeCuda(device_count=2):
        assert _device(opts) == "cuda:1"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_two_cuda_ranks_audit_with_a_backend_that_rejects_cpu_tensors(tmp_path):
    """Two ranks under the fake CUDA device, each seeing one GPU, with 'NCCL' serving CUDA tensors only: the
    audit runs to its end (before: 'No backend type associated with device type cpu' at the first collective)."""
    out = tmp_path / "out"
    with subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "tests" / "distributed" / "fake_nccl_worker.py"), MLP, str(out)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
                          start_new_session=True) as proc:
        try:
            _, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert proc.returncode == 0, err[-3000:]
    audit = json.loads((out / "audit.json").read_text())
    assert audit["distributed"]["backend"] == "cpu:gloo,cuda:fakenccl"
    assert audit["distributed"]["world_size"] == 2
    assert audit["mode"] == "cuda" and audit["device"].startswith("cuda"), "the audit ran as on a GPU"
    fc2 = next(L for L in audit["layers"] if L["name"] == "fc2")
    assert fc2["activation"]["elements"] == 32 * 128, "the global batch's figures, reduced across the ranks"


def _cli(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([MLP, *args])
    return code, err.getvalue()


@pytest.mark.parametrize("n", ["99999999999999999999", "1000", "3"])
def test_nproc_beyond_the_cores_is_refused_at_once(n, tmp_path, monkeypatch):
    """--nproc had no bound: 1000 started dozens of torch processes on 2 cores, 10**20 grew the launcher by
    ~110 MB/s. CPU ranks are capped by the cores this process may use (here made 2)."""
    import precision_audit.distributed as distributed

    monkeypatch.setattr(distributed, "_cpu_cores", lambda: 2, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    if hasattr(os, "sched_getaffinity"):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    t0 = time.monotonic()
    code, err = _cli("--nproc", n, "--out", str(tmp_path / "out"), "--device", "cpu")
    assert code == 2, err
    assert time.monotonic() - t0 < 30
    assert err.count("precision-audit: error") == 1 and f"--nproc {n}" in err and "at most 2" in err
    assert "CPU core" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_cuda_ranks_are_capped_by_the_visible_devices():
    from precision_audit.distributed import rank_limit

    with FakeCuda(device_count=3):
        assert rank_limit("cuda", False)[0] == 3
        assert rank_limit("auto", False)[0] == 3
        n, why = rank_limit("auto", True)  # --emulate: CPU ranks
        assert why.endswith("CPU core(s) this process may run on, one per rank") and n >= 1
    assert rank_limit("cpu", False)[0] == len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else True
    if not torch.cuda.is_available():
        assert "CPU core" in rank_limit("auto", False)[1]
