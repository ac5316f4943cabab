"""The distributed audit with NCCL on a real GPU (issue 31 defect 1): ``--nproc 1 --device cuda``.

Every distributed GPU audit crashed at its first collective while the process group was NCCL alone: NCCL serves
CUDA tensors only, and the audit's own checks and reductions are CPU tensors. The process group of CUDA ranks is
now ``cpu:gloo,cuda:nccl`` (precision_audit/distributed/run.py, ``backend_for``); one rank on one GPU makes every
collective of the audit (the checks, the reductions, the loss's all-reduce on the GPU, DDP's or FSDP's own), so
it shows the pairing serves them all. Without a GPU, tests/distributed/test_backend.py shows the same with a
backend that rejects CPU tensors as NCCL does. Run with: python -m pytest -m gpu tests/gpu/test_distributed_gpu.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fakecuda import REAL_CUDA

ROOT = Path(__file__).resolve().parent.parent.parent
SAMPLES = ROOT / "sample_models"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not REAL_CUDA, reason="needs a CUDA GPU")]


def _audit(model: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    with subprocess.Popen([sys.executable, "-m", "precision_audit", str(model), "--out", str(out), "--nproc", "1",
                           "--device", "cuda", "--steps", "0", "-q", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.parametrize("sample,args", [("mlp", ()), ("sharded_blocks", ()), ("tiny_gpt", ("--shard", "fsdp"))],
                         ids=["ddp", "parallelize-fsdp", "shard-fsdp"])
def test_one_rank_with_nccl_audits_on_the_gpu(sample, args, tmp_path):
    r = _audit(SAMPLES / sample / "model.py", tmp_path / "out", *args)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    audit = json.loads((tmp_path / "out" / "audit.json").read_text())
    assert audit["mode"] == "cuda" and audit["device"].startswith("cuda")
    assert audit["distributed"]["backend"] == "cpu:gloo,cuda:nccl"
    assert audit["distributed"]["world_size"] == 1
