"""Runtime overhead: a training step with the policy applied and the controller, against the same step written
by hand with torch.amp (autocast + GradScaler), measured in one run.

    python bench/runtime_overhead.py [--repeats 200]
    PA_WIDTH=4096 PA_BATCH=8192 python bench/runtime_overhead.py --device cuda     # on a GPU

Both loops run the residual-MLP probe (bench/models/residual_mlp.py; PA_DEPTH, PA_WIDTH, PA_BATCH pick its size)
under the same BF16 autocast (emulated on a CPU, torch's own with ``--device cuda``) with the same optimizer; the
policy keeps two modules in FP32 so that per-module switching is exercised, and the hand-written step keeps the
same two in FP32 by hand (``KeptInFp32``: on a GPU an FP32 GEMM costs many times a BF16 one, so a baseline
without them would charge the policy for the FP32 work it asks for). The row "the same after controller.close()"
times the controller after ``controller.close()`` has removed its hooks (the ones that let it name the source
of a non-finite step: since issue 14, two hooks on the root module that keep what a replay of a bad step needs;
docs/performance.md), which isolates what they cost on clean steps; the last, the policy's module wrappers with
the step written by hand, isolates what the controller adds; "by hand, skipping non-finite steps" is the
hand-written step with the guarantee the controller gives under BF16 (the gradients' total norm, no update when
it is not finite), the like-for-like baseline for what that guarantee costs. All run in interleaved rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import precision_audit as pa  # noqa: E402
from precision_audit.capture.emulation import CudaAutocastPolicy, emulated_autocast  # noqa: E402
from precision_audit.loading import load_batch, load_model, resolve_loss  # noqa: E402
from precision_audit.policy.schema import LossScaling, ModuleOverride, Policy, fingerprint, model_layout  # noqa: E402

FP32_MODULES = ("blocks.0.fc1", "head")


class KeptInFp32(torch.nn.Module):
    """What a user writes by hand to keep a module in FP32 inside an autocast region."""

    def __init__(self, inner: torch.nn.Module, device_type: str) -> None:
        super().__init__()
        self.inner, self.device_type = inner, device_type

    def forward(self, x):
        with torch.autocast(self.device_type, enabled=False):
            return self.inner(x.float())


def by_hand_model(model: torch.nn.Module, device_type: str) -> torch.nn.Module:
    """A copy of ``model`` with FP32_MODULES kept in FP32 by hand, as the policy keeps them."""
    hand = copy.deepcopy(model)
    for name in FP32_MODULES:
        parent, _, leaf = name.rpartition(".")
        owner = hand.get_submodule(parent) if parent else hand
        setattr(owner, leaf, KeptInFp32(getattr(owner, leaf), device_type))
    return hand


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cpu: CUDA autocast emulated on the CPU; cuda: the GPU, torch's own autocast (each step "
                         "timed between two device synchronisations)")
    args = ap.parse_args()
    dev = args.device
    model, source = load_model(str(ROOT / "bench" / "models" / "residual_mlp.py"))
    batch = load_batch(None, model, source)
    spec = resolve_loss(source, model(*batch.args), batch)
    model.to(dev)
    batch = batch.to(dev)

    def autocast():
        return torch.autocast("cuda", torch.bfloat16) if dev == "cuda" else emulated_autocast(torch.bfloat16)

    def sync() -> None:
        if dev == "cuda":
            torch.cuda.synchronize()
    fp, n = fingerprint(model)
    policy = Policy(model_class=type(model).__name__, model_fingerprint=fp, model_modules=n, target_name="H100 SXM",
                    target_compute_capability=(9, 0), default_format="bf16",
                    modules={m: ModuleOverride("fp32", "bench") for m in FP32_MODULES},
                    loss_scaling=LossScaling(enabled=False), model_layout=model_layout(model))

    def one(step) -> float:
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        return time.perf_counter() - t0

    with CudaAutocastPolicy() if dev == "cpu" else contextlib.nullcontext():
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        # the same step by hand, on a copy whose FP32 modules are kept in FP32 by hand (same work on a GPU, where
        # an FP32 GEMM costs many times a BF16 one)
        hand = by_hand_model(model, "cuda" if dev == "cuda" else "cpu")
        hand_opt = torch.optim.SGD(hand.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler(dev, enabled=False)
        box: dict = {}

        def step_by_hand(net, optimizer):
            def step():
                with autocast():
                    loss = spec(net(*batch.args), batch)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
            return step

        by_hand = step_by_hand(hand, hand_opt)

        def checked_by_hand(net, optimizer):
            # the same step with the guarantee the controller gives under BF16 (issue 11), written by hand: the
            # gradients' total norm, and no update when it is not finite (one device sync)
            params = [p for p in net.parameters() if p.requires_grad]

            def step():
                with autocast():
                    loss = spec(net(*batch.args), batch)
                loss.backward()
                norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
                if bool(torch.isfinite(norm)):
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            return step

        hand_checked = checked_by_hand(hand, hand_opt)
        # the policy's module wrappers, the step written by hand: what the controller adds
        policy_by_hand = step_by_hand(model, opt)

        def with_policy():
            with autocast():
                loss = spec(model(*batch.args), batch)
            box["controller"].step(loss)

        # Interleaved rounds (the order rotating), so that a machine whose load drifts affects all alike.
        # Each round: by hand; then with the policy applied, the step by hand, and with a fresh controller, one
        # step with its source hooks and, after controller.close() has removed them, one step without.
        times: dict[str, list[float]] = {"hand": [], "ours": [], "no_hooks": [], "wrappers": [], "checked": []}
        for r in range(args.repeats + 5):
            got: dict[str, float] = {}
            for what in (("hand", "policy"), ("policy", "hand"))[r % 2]:
                if what == "hand":
                    got["hand"] = one(by_hand)
                    got["checked"] = one(hand_checked)
                    continue
                handle = pa.apply_policy(model, policy, device_type=dev)
                got["wrappers"] = one(policy_by_hand)
                box["controller"] = pa.controller(model, opt, policy, device=dev)
                order = ("ours", "no_hooks") if r % 4 < 2 else ("no_hooks", "ours")
                if order[0] == "no_hooks":
                    box["controller"].close()
                got[order[0]] = one(with_policy)
                box["controller"].close()  # removes the source hooks; steps are still checked and skipped
                if order[1] == "ours":  # a fresh controller, hooks on
                    box["controller"] = pa.controller(model, opt, policy, device=dev)
                got[order[1]] = one(with_policy)
                box["controller"].close()
                handle.remove()
            if r >= 5:  # warm-up rounds
                for k, v in got.items():
                    times[k].append(v)
        base, ours, no_hooks, wrappers, checked = (statistics.median(times[k])
                                                   for k in ("hand", "ours", "no_hooks", "wrappers", "checked"))
        # the hooks' cost as the median of the paired per-round differences (robust to load drifting by round)
        hooks = statistics.median(a - b for a, b in zip(times["ours"], times["no_hooks"]))
    where = (f"{torch.cuda.get_device_name()}, torch's bf16 autocast" if dev == "cuda"
             else f"{torch.get_num_threads()} threads, emulated bf16")
    print(f"torch {torch.__version__}, {where}; residual MLP probe {model.blocks[0].fc1.in_features} wide, "
          f"{len(model.blocks)} blocks, batch {batch.args[0].shape[0]}")
    print(f"{'step':<34} {'median ms':>10} {'ratio':>7}")
    print(f"{'by hand (autocast + GradScaler)':<34} {base * 1e3:>10.3f} {1.0:>6.2f}x")
    print(f"{'apply_policy + controller.step':<34} {ours * 1e3:>10.3f} {ours / base:>6.2f}x")
    print(f"{'  the same after controller.close()':<34} {no_hooks * 1e3:>10.3f} {no_hooks / base:>6.2f}x")
    print(f"{'apply_policy, the step by hand':<34} {wrappers * 1e3:>10.3f} {wrappers / base:>6.2f}x")
    print(f"{'by hand, skipping non-finite steps':<34} {checked * 1e3:>10.3f} {checked / base:>6.2f}x")
    print(f"apply_policy + controller.step against the step by hand with the same non-finite check: "
          f"{ours / checked:.2f}x")
    print(f"source-attribution hooks, paired per round: {hooks * 1e3:+.3f} ms per step "
          f"({hooks / no_hooks:+.1%} of the step "
          "without them)")


if __name__ == "__main__":
    main()
