"""DDP on CPU: two processes (gloo) apply the same policy to a DistributedDataParallel model and train 5 FP16 steps
with the controller. They end with identical parameters, and when one rank alone sees an inf (rank 1, in a
``no_sync`` step, so DDP's gradient all-reduce cannot spread it) both ranks skip that step and keep equal scales."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())  # the repository
FP16_TROUBLE = ROOT / "sample_models" / "fp16_trouble"
WORLD = 2
STEPS = 5
INF_STEP = 2  # 0-based: the step at which rank 1 alone sees an inf


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        sys.path.insert(0, str(FP16_TROUBLE))
        import model as fp16_trouble
        import precision_audit as pa
        from precision_audit.policy import LossScaling, ModuleOverride, Policy, fingerprint, model_layout

        model = fp16_trouble.build_model()  # same seed: same initial weights on both ranks
        fp, n = fingerprint(model)
        policy = Policy(model_class="FP16Trouble", model_fingerprint=fp, model_modules=n, target_name="V100 SXM2",
                        target_compute_capability=(7, 0), default_format="fp16",
                        modules={"hot": ModuleOverride("fp32", "fp16 output reaches 1.97e+05 > 6.55e+04")},
                        loss_scaling=LossScaling(enabled=True, init_scale=131072.0, growth_interval=2),
                        model_layout=model_layout(model))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        handle = pa.apply_policy(ddp, policy)  # names without the "module." prefix
        assert handle.modules == {"hot": "fp32"}
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        ctl = pa.controller(ddp, opt, policy, device="cpu")
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        dtypes = {}
        model.hot.register_forward_hook(lambda m, i, o: dtypes.__setitem__("hot", o.dtype))
        model.head.register_forward_hook(lambda m, i, o: dtypes.__setitem__("head", o.dtype))
        rows = []
        for step in range(STEPS):
            x = torch.randn(16, 32, generator=g)
            y = torch.randn(16, 8, generator=g)
            if step == INF_STEP and rank == 1:
                x[0, 0] = float("inf")
            if step == INF_STEP:
                # no_sync: DDP does not all-reduce this step's gradients, so only rank 1's are non-finite
                with ddp.no_sync():
                    with pa.autocast(policy, "cpu"):
                        loss = F.mse_loss(ddp(x).float(), y)
                    rec = ctl.step(loss)
            else:
                with pa.autocast(policy, "cpu"):
                    loss = F.mse_loss(ddp(x).float(), y)
                rec = ctl.step(loss)
            rows.append({"skipped": rec.skipped, "scale": ctl.scaler.get_scale(),
                         "tracker": ctl.scaler.state_dict()["_growth_tracker"],
                         "nonfinite": rec.nonfinite_modules})
        torch.save({"rows": rows, "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "dtypes": dtypes}, os.path.join(out_dir, f"rank{rank}.pt"))
        handle.remove()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_ranks_train_identically_and_skip_together(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD))
    assert r0["dtypes"] == r1["dtypes"] == {"hot": torch.float32, "head": torch.float16}
    # the skip decision and the scaler agree at every step
    for key in ("skipped", "scale", "tracker"):
        assert [r[key] for r in r0["rows"]] == [r[key] for r in r1["rows"]], key
    skipped = [r["skipped"] for r in r0["rows"]]
    assert skipped == [i == INF_STEP for i in range(STEPS)], skipped
    # ...although only rank 1 saw non-finite gradients: both report rank 1's modules (the scan is all-reduced,
    # docs/distributed.md, "The runtime across ranks")
    assert r0["rows"][INF_STEP]["nonfinite"] == r1["rows"][INF_STEP]["nonfinite"]
    assert "hot" in r1["rows"][INF_STEP]["nonfinite"]
    assert "module.hot" not in r1["rows"][INF_STEP]["nonfinite"]
    # growth every 2 clean steps, one backoff: 2^17 -> 2^18 (steps 0-1) -> 2^17 (skip) -> 2^18 (steps 3-4)
    assert [r["scale"] for r in r0["rows"]] == [131072.0, 262144.0, 131072.0, 131072.0, 262144.0]
    for k in r0["params"]:
        assert torch.equal(r0["params"][k], r1["params"][k]), f"{k} differs between the ranks"
        assert torch.isfinite(r0["params"][k]).all()
