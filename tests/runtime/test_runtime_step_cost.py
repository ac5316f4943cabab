"""Issue 33 decision 3 / issue 31 defect 7: what a clean controller step costs beyond the hand-written step with the
same guarantee, counted on the CPU as the proxy for a launch-bound GPU (bench/runtime_overhead.py ``--count``):
operators dispatched that are not views (about one kernel launch each on a GPU) and reads to the host (a device
sync each on a GPU).

The baselines: for bf16, autocast + the gradients' total norm + one read of whether it is finite + the update only
then; for fp16, autocast + torch.amp.GradScaler (its own found-inf read in ``step``). The controller reads its one
set of values (loss, norm, found_inf, scale) in one transfer and adds only the range of the model's output (for
the replay that names a bad step's source) and the concatenation of what it reads.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import precision_audit as pa
from precision_audit.policy import LossScaling, Policy, fingerprint, model_layout


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.syncs = 0
        self.from_host = 0  # tensors made from host data: on a GPU a pageable copy, which waits for the stream
        self._tolist = torch.Tensor.tolist

    def __enter__(self):
        counter, tolist = self, self._tolist

        def counted(t):
            counter.syncs += 1
            return tolist(t)

        torch.Tensor.tolist = counted  # a CPU tolist dispatches nothing
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        ret = func._schema.returns
        if name in ("_local_scalar_dense", "is_nonzero", "equal"):
            self.syncs += 1
        elif name == "lift_fresh":
            self.from_host += 1
        elif not ((ret and ret[0].alias_info is not None and not ret[0].alias_info.is_write)
                  or name.startswith("empty")):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


def _policy(model: nn.Module, fmt: str) -> Policy:
    fp, n = fingerprint(model)
    return Policy(model_class="Net", model_fingerprint=fp, model_modules=n, target_name="t",
                  target_compute_capability=None, default_format=fmt, modules={},
                  loss_scaling=LossScaling(enabled=fmt == "fp16", init_scale=256.0), model_layout=model_layout(model))


def _hand_step(model, opt, fmt, x, y):
    if fmt == "fp16":
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)

        def step():
            with torch.autocast("cpu", torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        return step
    params = list(model.parameters())

    def step():
        with torch.autocast("cpu", torch.bfloat16):
            loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if bool(torch.isfinite(norm)):
            opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _count(step) -> Count:
    step()  # warm: the optimizer's state, the GradScaler's lazily made tensors
    with Count() as c:
        step()
    return c


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_a_clean_step_reads_the_device_once_and_adds_two_operators(fmt):
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    hand = Net()
    mine = Net()
    mine.load_state_dict(hand.state_dict())
    base = _count(_hand_step(hand, torch.optim.SGD(hand.parameters(), lr=0.01), fmt, x, y))
    policy = _policy(mine, fmt)
    ctl = pa.controller(mine, torch.optim.SGD(mine.parameters(), lr=0.01), policy, device="cpu")

    def ours():
        with pa.autocast(policy, "cpu"):
            loss = F.mse_loss(mine(x).float(), y)
        ctl.step(loss)

    got = _count(ours)
    assert got.syncs == base.syncs == 1, (got.syncs, base.syncs)
    assert got.from_host == 0, "a tensor made from host data: on a GPU, a second wait for the stream"
    added = got.ops - base.ops
    if fmt == "fp16":  # the GradScaler is the gate; the norm is the monitor's figure (one read of the gradients)
        grads = [torch.ones(3), torch.ones(4)]
        added -= _count(lambda: torch.nn.utils.get_total_norm(grads)).ops
    assert sum(added.values()) <= 2 and set(added) <= {"aminmax", "cat"}, dict(added)
    ctl.close()
