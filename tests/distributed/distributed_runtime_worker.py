"""One rank of tests/distributed/test_distributed_runtime.py, started by torchrun (gloo, CPU): trains a small model
under a
policy with the runtime (apply_policy + controller, adaptive) under FSDP2 or DDP, with an overflow injected on
ONE rank only, and writes what the test compares across ranks.

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/distributed_runtime_worker.py MODE OUT_DIR

MODE: ``fsdp`` (precision_audit.shard_fsdp2, fp32 parameters), ``fsdp_policy`` (shard_fsdp2 with each unit's
parameters in its format), ``ddp``, ``ddp_nosync`` (DDP inside ``no_sync()``: no gradient all-reduce carries rank
1's overflow to rank 0, only the controller's agreement does; both ranks get the same samples), or ``refuse``
(fully_shard gathering fp16 for a policy that keeps a module in fp32: apply_policy must refuse it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import precision_audit as pa
from precision_audit.policy import LossScaling, ModuleOverride, Policy, fingerprint, model_layout

STEPS = 8
INJECTED = (3, 4, 5)  # steps (1-based) at which rank 1's "mid" overflows; rank 0 stays finite throughout
BAD_RANK = 1


class Spiky(nn.Module):
    """A linear layer whose output goes past every float format's range when ``inject`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.inject = False

    def forward(self, x):
        y = self.lin(x)
        return y * 1e39 if self.inject else y


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.mid = Spiky()
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x)))))


def make_policy(model: nn.Module) -> Policy:
    fp, n = fingerprint(model)
    return Policy(model_class=type(model).__name__, model_fingerprint=fp, model_modules=n, target_name="H100 SXM",
                  target_compute_capability=(9, 0), default_format="fp16",
                  modules={"out": ModuleOverride("fp32", "kept in fp32 by the test")},
                  loss_scaling=LossScaling(enabled=True, init_scale=1024.0, growth_interval=10_000),
                  model_layout=model_layout(model))


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.clone()
    return out


def main() -> None:
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Net()
    policy = make_policy(model)
    if mode == "refuse":  # fp16 parameters gathered for the whole model, which the policy keeps "out" fp32 in
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
        try:
            pa.apply_policy(model, policy)
        except pa.AuditError as e:
            (out_dir / f"refused.rank{rank}.txt").write_text(str(e))
        dist.barrier()  # no rank tears gloo down while another still talks to it
        dist.destroy_process_group()
        return
    if mode in ("fsdp", "fsdp_policy"):
        pa.shard_fsdp2(model, policy, param_dtype="policy" if mode == "fsdp_policy" else "fp32")
        run = model
    else:  # ddp; ddp_nosync: gradients never synchronised, so rank 1's overflow stays on rank 1
        run = nn.parallel.DistributedDataParallel(model)
    handle = pa.apply_policy(run, policy)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctl = pa.controller(run, opt, policy, device="cpu", adaptive=True, promote_after=3)
    # each rank its own samples; under ddp_nosync the same ones, so that unsynchronised ranks still train alike
    g = torch.Generator().manual_seed(100 + (0 if mode == "ddp_nosync" else rank))
    sync = run.no_sync if mode == "ddp_nosync" else contextlib.nullcontext
    steps = []
    for step in range(1, STEPS + 1):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        model.mid.inject = rank == BAD_RANK and step in INJECTED
        before = full_params(model)
        with sync():
            with pa.autocast(policy, "cpu"):
                loss = F.mse_loss(run(x).float(), y)
            rec = ctl.step(loss)
        after = full_params(model)
        steps.append({"step": step, "skipped": rec.skipped, "promoted": list(rec.promoted),
                      "sources": list(rec.sources), "nonfinite": list(rec.nonfinite_modules),
                      "scale": rec.scale, "unchanged": all(torch.equal(before[k], after[k]) for k in before)})
    params = full_params(model)
    digest = hashlib.sha256(b"".join(bytes(t.float().contiguous().reshape(-1).view(torch.uint8).tolist())
                                    for _, t in sorted(params.items()))).hexdigest()
    ctl.save_policy(out_dir / f"policy.rank{rank}.json")
    from torch.distributed.fsdp import FSDPModule

    units = {n: str(m._get_fsdp_state()._mp_policy.param_dtype) for n, m in model.named_modules()
             if isinstance(m, FSDPModule)}
    result = {"rank": rank, "units": units, "steps": steps, "skipped_steps": ctl.skipped_steps, "param_digest": digest,
              "finite": all(bool(torch.isfinite(t).all()) for t in params.values()),
              "handle_modules": dict(handle.modules), "policy_modules": sorted(ctl.policy.modules)}
    (out_dir / f"result.rank{rank}.json").write_text(json.dumps(result, indent=1))
    ctl.close()
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
