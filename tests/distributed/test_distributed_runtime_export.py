"""Issue 15 item 6: the file ``precision-audit export POLICY --to fsdp`` writes runs as generated under torchrun
(2 ranks, gloo, CPU): its ``shard_fsdp2`` makes the policy's fp32 module a unit of its own gathered in fp32 and
the rest fp16, the module kept in fp32 returns fp32 under its ``forward_autocast`` (it was cast back to fp16,
issue 32), its ``scaler`` (ShardedGradScaler) skips the step in which rank 1's forward overflowed on both ranks,
and the ranks end with finite, identical parameters.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from distributed_runtime_worker import Net, make_policy  # noqa: E402

from precision_audit.policy import save_policy  # noqa: E402
from test_distributed_runtime import ROOT, torchrun  # noqa: E402


def test_generated_fsdp_file_trains_under_torchrun(tmp_path):
    torch.manual_seed(0)
    save_policy(make_policy(Net()), tmp_path / "policy.json")
    gen = tmp_path / "fsdp_settings.py"
    r = subprocess.run([sys.executable, "-m", "precision_audit", "export", str(tmp_path / "policy.json"), "--to",
                        "fsdp", "--out", str(gen)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "'out': torch.float32," in gen.read_text()
    r = torchrun(ROOT / "tests" / "distributed" / "distributed_export_worker.py", str(gen), str(tmp_path))
    assert r.returncode == 0, r.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"result.rank{k}.json").read_text()) for k in (0, 1)]
    for res in ranks:
        assert res["units"] == {"": "torch.float16", "out": "torch.float32"}
        assert res["scaler_enabled"] and res["finite"]
        assert [s["unchanged"] for s in res["steps"]] == [False, True, False, False]  # step 2 skipped
        assert [s["scale"] for s in res["steps"]] == [1024.0, 1024.0, 512.0, 512.0]
        assert all(s["out_dtype"] == "torch.float32" for s in res["steps"])  # kept in fp32, not cast back
    assert ranks[0]["steps"][1]["loss_finite"] and not ranks[1]["steps"][1]["loss_finite"]  # one rank only
    assert ranks[0]["params"] == ranks[1]["params"]
