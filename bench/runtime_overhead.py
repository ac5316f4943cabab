"""Runtime overhead: a training step with the policy applied and the controller, against the same step written
by hand with torch.amp (autocast + GradScaler), measured in one run.

    python bench/runtime_overhead.py [--repeats 200]

Both loops run the residual-MLP probe (bench/models/residual_mlp.py) under the same emulated BF16 autocast with
the same optimizer; the policy keeps two modules in FP32 so that per-module switching is exercised. The last row
times the controller after ``controller.close()`` has removed its hooks (the ones that let it name the source
of a non-finite step: since issue 14, two hooks on the root module that keep what a replay of a bad step needs;
docs/performance.md), which isolates what they cost on clean steps. The three run in interleaved rounds.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    model, source = load_model(str(ROOT / "bench" / "models" / "residual_mlp.py"))
    batch = load_batch(None, model, source)
    spec = resolve_loss(source, model(*batch.args), batch)
    fp, n = fingerprint(model)
    policy = Policy(model_class=type(model).__name__, model_fingerprint=fp, model_modules=n, target_name="H100 SXM",
                    target_compute_capability=(9, 0), default_format="bf16",
                    modules={"blocks.0.fc1": ModuleOverride("fp32", "bench"), "head": ModuleOverride("fp32", "bench")},
                    loss_scaling=LossScaling(enabled=False), model_layout=model_layout(model))

    def one(step) -> float:
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0

    with CudaAutocastPolicy():
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        box: dict = {}

        def by_hand():
            with emulated_autocast(torch.bfloat16):
                loss = spec(model(*batch.args), batch)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)

        def with_policy():
            with emulated_autocast(torch.bfloat16):
                loss = spec(model(*batch.args), batch)
            box["controller"].step(loss)

        # Interleaved rounds (the order rotating), so that a machine whose load drifts affects all three alike.
        # Each round: by hand; then with the policy applied and a fresh controller, one step with its source
        # hooks and, after controller.close() has removed them, one step without.
        times: dict[str, list[float]] = {"hand": [], "ours": [], "no_hooks": []}
        for r in range(args.repeats + 5):
            got: dict[str, float] = {}
            for what in (("hand", "policy"), ("policy", "hand"))[r % 2]:
                if what == "hand":
                    got["hand"] = one(by_hand)
                    continue
                handle = pa.apply_policy(model, policy, device_type="cpu")
                box["controller"] = pa.controller(model, opt, policy, device="cpu")
                order = ("ours", "no_hooks") if r % 4 < 2 else ("no_hooks", "ours")
                if order[0] == "no_hooks":
                    box["controller"].close()
                got[order[0]] = one(with_policy)
                box["controller"].close()  # removes the source hooks; steps are still checked and skipped
                if order[1] == "ours":  # a fresh controller, hooks on
                    box["controller"] = pa.controller(model, opt, policy, device="cpu")
                got[order[1]] = one(with_policy)
                box["controller"].close()
                handle.remove()
            if r >= 5:  # warm-up rounds
                for k, v in got.items():
                    times[k].append(v)
        base, ours, no_hooks = (statistics.median(times[k]) for k in ("hand", "ours", "no_hooks"))
        # the hooks' cost as the median of the paired per-round differences (robust to load drifting by round)
        hooks = statistics.median(a - b for a, b in zip(times["ours"], times["no_hooks"]))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; residual MLP probe, emulated bf16")
    print(f"{'step':<34} {'median ms':>10} {'ratio':>7}")
    print(f"{'by hand (autocast + GradScaler)':<34} {base * 1e3:>10.3f} {1.0:>6.2f}x")
    print(f"{'apply_policy + controller.step':<34} {ours * 1e3:>10.3f} {ours / base:>6.2f}x")
    print(f"{'  the same after controller.close()':<34} {no_hooks * 1e3:>10.3f} {no_hooks / base:>6.2f}x")
    print(f"source-attribution hooks, paired per round: {hooks * 1e3:+.3f} ms per step "
          f"({hooks / no_hooks:+.1%} of the step "
          "without them)")


if __name__ == "__main__":
    main()
