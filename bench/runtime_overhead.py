"""Runtime overhead: a training step with the policy applied and the controller, against the same step written
by hand with torch.amp (autocast + GradScaler), measured in one run.

    python bench/runtime_overhead.py [--repeats 200]

Both loops run the residual-MLP probe (bench/models/residual_mlp.py) under the same emulated BF16 autocast with
the same optimizer; the policy keeps two modules in FP32 so that per-module switching is exercised.
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

    def timed(step) -> float:
        for _ in range(10):
            step()
        ts = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    with CudaAutocastPolicy():
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler("cpu", enabled=False)

        def by_hand():
            with emulated_autocast(torch.bfloat16):
                loss = spec(model(*batch.args), batch)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)

        base = timed(by_hand)
        handle = policy.apply(model, device_type="cpu")
        controller = policy.controller(model, opt, device="cpu")

        def with_policy():
            with emulated_autocast(torch.bfloat16):
                loss = spec(model(*batch.args), batch)
            controller.step(loss)

        ours = timed(with_policy)
        controller.close()
        handle.remove()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; residual MLP probe, emulated bf16")
    print(f"{'step':<34} {'median ms':>10} {'ratio':>7}")
    print(f"{'by hand (autocast + GradScaler)':<34} {base * 1e3:>10.3f} {1.0:>6.2f}x")
    print(f"{'policy.apply + controller.step':<34} {ours * 1e3:>10.3f} {ours / base:>6.2f}x")


if __name__ == "__main__":
    main()
