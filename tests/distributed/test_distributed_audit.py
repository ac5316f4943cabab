"""Issue 15: the audit across ranks (torchrun, 2 ranks, gloo on the CPU) equals the single-process audit.

Each test starts real ranks through ``precision-audit ... --nproc 2`` (torch.distributed.run's launcher) and
compares the distributed audit.json with the single-process one of the same global batch, field by field
(tests/distributed_compare.py: counts exact, error metrics within 1e-6 relative). Both run one CPU thread per
process, so that the FP32 GEMMs sum in the same order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from precision_audit.distributed.compare import differences  # noqa: E402

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())  # the repository
SAMPLES = ROOT / "sample_models"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def audit(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    # its own session, so that a timeout ends the ranks too, not only the launcher
    with subprocess.Popen([sys.executable, "-m", "precision_audit", *args, "-q"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _compare(model: str, tmp_path: Path, *extra: str) -> tuple[dict, dict]:
    single = audit(model, "--out", str(tmp_path / "one"), *[e for e in extra if e not in ("--shard", "fsdp", "ddp")])
    assert single.returncode in (0, 1), single.stderr[-2000:]
    multi = audit(model, "--out", str(tmp_path / "two"), "--nproc", "2", *extra)
    assert multi.returncode == single.returncode, multi.stderr[-3000:]
    a = json.loads((tmp_path / "one" / "audit.json").read_text())
    b = json.loads((tmp_path / "two" / "audit.json").read_text())
    diff = differences(a, b)
    assert not diff, "\n".join(diff[:30])
    return a, b


def test_ddp_audit_equals_single_process(tmp_path):
    """mlp, global batch of 32 split 16 + 16, DDP (the default): every figure equal to the single-process audit."""
    a, b = _compare(str(SAMPLES / "mlp" / "model.py"), tmp_path)
    d = b["distributed"]
    assert d["world_size"] == 2 and d["parallelism"] == "DistributedDataParallel"
    assert d["global_batch_size"] == 32 and d["rank0_batch_size"] == 16
    # the figures compared are real: the layers carry counts of the global batch (32 samples x 128 features)
    fc2 = next(L for L in b["layers"] if L["name"] == "fc2")
    assert fc2["activation"]["elements"] == 32 * 128
    assert not list((tmp_path / "two").glob(".*staging*"))


LOSS_MODULE = """
import torch, torch.nn as nn
class M(nn.Module):
    def __init__(s):
        super().__init__()
        s.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
        s.loss_fct = nn.CrossEntropyLoss()
    def forward(s, x, labels):
        logits = s.net(x)
        return {'loss': s.loss_fct(logits, labels), 'logits': logits}
def build_model():
    torch.manual_seed(0); return M()
def sample_batch():
    g = torch.Generator().manual_seed(0)
    return {'x': torch.randn(64, 32, generator=g), 'labels': torch.randint(0, 10, (64,), generator=g)}
"""


def test_a_loss_modules_own_gradient_is_left_out_on_every_rank(tmp_path):
    """The model's loss is a registered loss module's output, which the ranks' sum replaces: that module's output
    gradient is still dL/dL (times the rank's weight), not an FP16 gradient, so the loss scale is the one
    process's (2^18 here, where counting it gave 2^15)."""
    src = tmp_path / "model.py"
    src.write_text(LOSS_MODULE)
    # (the loss module's own figures are each rank's scalar, not the whole batch's: audit.json as a whole differs)
    one, two = (audit(str(src), "--out", str(tmp_path / d), *x) for d, x in (("one", ()), ("two", ("--nproc", "2"))))
    assert one.returncode == two.returncode == 0, two.stderr[-2000:]
    a, b = (json.loads((tmp_path / d / "audit.json").read_text())["loss_scale"] for d in ("one", "two"))
    assert "loss_fct" not in b["gradients"]["largest_in"]
    assert b["gradients"]["largest_in"] == a["gradients"]["largest_in"]
    assert b["recommended_init_scale"] == a["recommended_init_scale"] == 2.0**18


def test_user_parallelize_fsdp_and_per_rank_sample_batch(tmp_path):
    """sharded_blocks: the file's parallelize() (fully_shard per block and root), sample_batch(rank, world_size),
    and a tensor every rank shares (the position table's output): equal to the single-process audit, module names
    and classes as in named_modules() (FSDP's class swap invisible)."""
    a, b = _compare(str(SAMPLES / "sharded_blocks" / "model.py"), tmp_path)
    assert b["model"]["class"] == "ShardedBlocks"
    assert [L["type"] for L in b["layers"]] == [L["type"] for L in a["layers"]]
    assert "parallelize" in b["distributed"]["parallelism"]
    pos = next(L for L in b["layers"] if L["name"] == "positions")
    assert pos["activation"]["elements"] == 8 * 64  # counted once, not once per rank
    policy = json.loads((tmp_path / "two" / "policy.json").read_text())
    assert policy["model"]["class"] == "ShardedBlocks"


@pytest.mark.slow
def test_shard_fsdp_tiny_gpt(tmp_path):
    """--shard fsdp on tiny_gpt (fully_shard on each of its blocks and the root), causal mask and position
    embedding shared by the ranks."""
    _, b = _compare(str(SAMPLES / "tiny_gpt" / "model.py"), tmp_path, "--shard", "fsdp")
    assert b["distributed"]["parallelism"].startswith("fully_shard on each of the 2 blocks of 'blocks'")


def test_batch_that_does_not_split_is_refused(tmp_path):
    import torch

    batch = tmp_path / "odd.pt"
    g = torch.Generator().manual_seed(0)
    torch.save((torch.randn(33, 64, generator=g), torch.randint(0, 16, (33,), generator=g)), batch)
    out = tmp_path / "out"
    r = audit(str(SAMPLES / "mlp" / "model.py"), "--batch", str(batch), "--out", str(out), "--nproc", "2")
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("precision-audit: error") == 1, r.stderr
    assert "does not split evenly across 2 ranks" in r.stderr and "batch size 33" in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()


FAILING = '''
import os
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        if os.environ.get("RANK") == "1":
            raise ValueError("rank one cannot take this batch")
        return self.fc(x)


def build_model():
    torch.manual_seed(0)
    return Net()


def sample_batch():
    return torch.randn(8, 8), torch.randint(0, 4, (8,))
'''


def test_exception_on_one_rank_ends_every_rank(tmp_path):
    model = tmp_path / "failing.py"
    model.write_text(FAILING)
    out = tmp_path / "out"
    t0 = time.perf_counter()
    r = audit(str(model), "--out", str(out), "--nproc", "2", timeout=120)
    elapsed = time.perf_counter() - t0
    assert r.returncode == 2, r.stderr[-2000:]
    assert elapsed < 60
    lines = [x for x in r.stderr.splitlines() if x.startswith("precision-audit:")]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("precision-audit: error (rank 1 of 2): the model raised ValueError")
    assert "rank one cannot take this batch" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_ctrl_c_on_the_launcher_exits_130(tmp_path):
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "precision_audit", str(SAMPLES / "tiny_gpt" / "model.py"), "--out",
                          str(out), "--nproc", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env(), cwd=ROOT)
    deadline = time.time() + 90
    started = False
    assert p.stderr is not None
    while time.time() < deadline:  # rank 0's progress: the ranks are running
        line = p.stderr.readline()
        if "FP32 reference pass" in line or "fp16 pass" in line:
            started = True
            break
        if not line and p.poll() is not None:
            break
    assert started, p.stderr.read()[-2000:] if p.poll() is not None else "no progress line"
    p.send_signal(signal.SIGINT)
    try:
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, err[-2000:]
    assert "interrupted" in err
    assert not out.exists() or not any(out.iterdir())


def test_shard_without_ranks_is_refused(tmp_path):
    r = audit(str(SAMPLES / "mlp" / "model.py"), "--out", str(tmp_path / "out"), "--shard", "fsdp", timeout=60)
    assert r.returncode == 2 and "--shard applies to a distributed audit only" in r.stderr
    assert not (tmp_path / "out").exists()


def test_ddp_gets_the_no_buffer_sync_option_its_torch_release_has():
    """torch 2.13 added ``forward_sync_buffers`` and deprecated ``broadcast_buffers``; torch 2.11's DDP has only the
    latter, and passing the new keyword there ended every DDP audit with an internal error (seen on 2.11.0+cu130)."""
    from precision_audit.distributed.shard import _no_buffer_sync_in_forward

    class Before213:
        def __init__(self, module, broadcast_buffers=True, find_unused_parameters=False):
            pass

    class From213(Before213):
        def __init__(self, module, broadcast_buffers=None, find_unused_parameters=False, forward_sync_buffers=None):
            pass

    assert _no_buffer_sync_in_forward(Before213) == {"broadcast_buffers": False}
    assert _no_buffer_sync_in_forward(From213) == {"forward_sync_buffers": False}
    from torch.nn.parallel import DistributedDataParallel as DDP

    kw = _no_buffer_sync_in_forward(DDP)
    assert len(kw) == 1 and not next(iter(kw.values()))
