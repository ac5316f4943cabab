"""Issue 15 item 6: the runtime across ranks (2 ranks, gloo, CPU, started by torchrun).

tests/distributed/distributed_runtime_worker.py trains an fp16 policy (loss scaling on, ``out`` kept in fp32) with
``apply_policy`` + the adaptive controller for 8 steps, each rank on its own samples, and makes ``mid``'s output
overflow on rank 1 ONLY at steps 3, 4 and 5. Every rank must skip exactly those steps (leaving the parameters
bit-identical), back the loss scale off in step, end with finite parameters identical across ranks, promote
``mid`` at step 5 on every rank, and save byte-identical policy files. Under FSDP2 and DDP the gradient reduction
itself spreads rank 1's inf to rank 0's gradients; ``ddp_nosync`` (DDP's ``no_sync()``) keeps it on rank 1, so
only the controller's all-reduced found-inf flag makes rank 0 skip.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "distributed" / "distributed_runtime_worker.py"


def torchrun(script: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    # its own session, so that a timeout ends the ranks too, not only the launcher (they would be left waiting
    # in a collective, holding CPU and ports, after the test has failed)
    with subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--standalone", str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env, cwd=ROOT, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _results(out: Path) -> list[dict]:
    return [json.loads((out / f"result.rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("mode", ["fsdp", "ddp", "fsdp_policy", "ddp_nosync"])
def test_overflow_on_one_rank_skips_and_promotes_on_every_rank(tmp_path, mode):
    r = torchrun(WORKER, mode, str(tmp_path))
    assert r.returncode == 0, r.stderr[-4000:]
    ranks = _results(tmp_path)
    for res in ranks:
        skipped = [s["step"] for s in res["steps"] if s["skipped"]]
        assert skipped == [3, 4, 5], (res["rank"], skipped)
        # a skipped step leaves the parameters bit-identical; the others change them
        assert all(s["unchanged"] == s["skipped"] for s in res["steps"])
        assert res["finite"]
        # the GradScaler backs off once per skipped step, on every rank alike (init 1024, backoff 0.5)
        assert [s["scale"] for s in res["steps"]] == [1024.0, 1024.0, 1024.0, 512.0, 256.0, 128.0, 128.0, 128.0]
        # rank 0 saw nothing non-finite itself, yet names the same source and the same modules as rank 1
        assert [s["sources"] for s in res["steps"] if s["skipped"]] == [["mid"]] * 3
        assert [s["promoted"] for s in res["steps"]] == [[], [], [], [], ["mid"], [], [], []]
        assert res["policy_modules"] == ["mid", "out"]
    assert ranks[0]["steps"] == ranks[1]["steps"]
    assert ranks[0]["param_digest"] == ranks[1]["param_digest"]
    p0, p1 = ((tmp_path / f"policy.rank{r}.json").read_bytes() for r in (0, 1))
    assert p0 == p1
    saved = json.loads(p0)["modules"]["mid"]
    assert saved["format"] == "fp32" and "step 5" in saved["reason"] and "(3, 4, 5)" in saved["reason"]
    assert "on another rank" not in saved["reason"]  # rank 1's own observation, agreed on every rank
    if mode == "fsdp_policy":
        # each unit gathers its parameters in its format: the root in fp16, "out" (fp32) a unit of its own
        assert ranks[0]["units"] == {"": "torch.float16", "out": "None"}
        # "mid"'s parameters are gathered in the root unit's fp16: the promotion waits for the next sharding
        assert ranks[0]["handle_modules"] == {"out": "fp32"}
        assert "cannot take effect now" in r.stderr and "mid -> fp32" in r.stderr
    else:
        assert ranks[0]["handle_modules"] == {"mid": "fp32", "out": "fp32"}
    if mode == "fsdp":
        assert ranks[0]["units"] == {"": "None"}  # fp32 parameters: autocast alone decides, as in the audit


@pytest.mark.slow
def test_fsdp_and_ddp_train_the_same_parameters(tmp_path):
    """FSDP2 with fp32 parameters (shard_fsdp2's default) and DDP compute the same mean gradient of the same
    samples: the same parameters after 8 steps, bit for bit (a cross-check of the sharded gradient handling)."""
    digests = []
    for mode in ("fsdp", "ddp"):
        out = tmp_path / mode
        out.mkdir()
        r = torchrun(WORKER, mode, str(out))
        assert r.returncode == 0, r.stderr[-4000:]
        digests.append(_results(out)[0]["param_digest"])
    assert digests[0] == digests[1]


def test_apply_policy_refuses_units_gathered_in_the_wrong_format(tmp_path):
    r = torchrun(WORKER, "refuse", str(tmp_path))
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in (0, 1):
        text = (tmp_path / f"refused.rank{rank}.txt").read_text()
        assert "out (fp32, gathered in float16)" in text and "shard_fsdp2" in text
