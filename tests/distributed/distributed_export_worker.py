"""One rank of tests/distributed/test_distributed_runtime_export.py, started by torchrun (gloo, CPU):
imports the file that ``precision-audit export POLICY --to fsdp`` generated, shards the test model with
its ``shard_fsdp2`` and trains 4 steps under its ``forward_autocast`` with its ``scaler`` (ShardedGradScaler),
with an overflow on rank 1 only at step 2.

    python -m torch.distributed.run --nproc-per-node 2 --standalone tests/distributed/distributed_export_worker.py \\
        GEN.py OUT_DIR
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from distributed_runtime_worker import Net, full_params  # noqa: E402

from precision_audit.capture.emulation import CudaAutocastPolicy  # noqa: E402

STEPS = 4
INJECTED = 2
BAD_RANK = 1


def main() -> None:
    gen_path, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spec = importlib.util.spec_from_file_location("generated_fsdp", gen_path)
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    torch.manual_seed(0)
    model = gen.shard_fsdp2(Net())
    from torch.distributed.fsdp import FSDPModule

    units = {n: str(m._get_fsdp_state()._mp_policy.param_dtype) for n, m in model.named_modules()
             if isinstance(m, FSDPModule)}
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = gen.scaler
    g = torch.Generator().manual_seed(100 + rank)
    steps = []
    for step in range(1, STEPS + 1):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        model.mid.inject = rank == BAD_RANK and step == INJECTED
        before = full_params(model)
        # the generated forward context (the policy's autocast), with CUDA's autocast op policy emulated on the CPU
        with CudaAutocastPolicy(), gen.forward_autocast("cpu"):
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        after = full_params(model)
        steps.append({"step": step, "out_dtype": str(out.dtype), "scale": scale,
                      "unchanged": all(torch.equal(before[k], after[k]) for k in before),
                      "loss_finite": bool(torch.isfinite(loss))})
    params = full_params(model)
    result = {"rank": rank, "units": units, "steps": steps, "scaler_enabled": scaler.is_enabled(),
              "finite": all(bool(torch.isfinite(t).all()) for t in params.values()),
              "params": {k: t.tolist() for k, t in params.items()}}
    (out_dir / f"result.rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
