"""FP8 planner quality: our FP8 plan against an exhaustive one-module-at-a-time search, at the same budget.

    python bench/fp8_planner_quality.py [--depth 6] [--width 2048] [--tokens-per-step 65536]

Model: a residual stack of ``depth`` blocks of Linear(width, width), with issue 16's two planted layers at the
front (outlier tokens, outlier channels; docs/fp8.md). Costs on an H100 at ``--tokens-per-step`` rows.

Ours (precision_audit/fp8/plan.py): one measurement pass per recipe (local and accumulated), the choice per
module, one verification run of the chosen set (plus one per repair).

Baseline: for every module and every recipe that pays on the target, run the model with only that module under
that recipe (modules x recipes passes); per module keep the fastest recipe whose single run meets the budget;
take modules in order of their measured loss change while the summed change stays within the budget, verify,
and drop the last ones until the verified run meets the budget. Goal (issue 16): ours reaches >= 95% of the
baseline's FP8 share of GEMM FLOPs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from precision_audit.fp8.cost import layer_cost  # noqa: E402
from precision_audit.fp8.measure import measure_fp8  # noqa: E402
from precision_audit.fp8.plan import TORCHAO_RECIPES, make_verifier, plan_fp8  # noqa: E402
from precision_audit.gpus import resolve_target  # noqa: E402

OUTLIER = 2.0 ** 17


class Stack(nn.Module):
    def __init__(self, depth: int, width: int):
        super().__init__()
        self.tokens = nn.Linear(width, width)
        self.channels = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 64)
        gain = torch.ones(width)
        gain[32:64] = OUTLIER
        self.register_buffer("gain", gain)
        with torch.no_grad():
            self.channels.weight[:, 32:64] /= OUTLIER
            for b in self.blocks:
                b.weight.mul_(0.5)

    def forward(self, x):
        h = self.tokens(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = F.gelu(self.channels(h * self.gain))
        for b in self.blocks:
            h = h + F.gelu(b(h))
        return self.head(h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=32, help="rows in the audited batch")
    ap.add_argument("--tokens-per-step", type=int, default=65536, help="rows per training step, for the cost")
    ap.add_argument("--budget", type=float, default=0.05, help="max local / output relative error and loss change")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = Stack(args.depth, args.width)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, args.width, generator=g)
    x[[1, args.tokens // 2]] *= OUTLIER
    y = torch.randn(args.tokens, 64, generator=g)
    fwd, loss_of = (lambda m: m(x)), (lambda o: F.mse_loss(o, y))
    target = resolve_target("h100")
    b = args.budget

    t0 = time.perf_counter()
    r = measure_fp8(model, fwd, loss_of, TORCHAO_RECIPES, history_steps=1)
    verify = make_verifier(model, fwd, loss_of, r.reference_outputs)
    calls = {"n": 0}

    def counted(mods):
        calls["n"] += 1
        return verify(mods)

    ours = plan_fp8(r, target, max_local_rel_error=b, max_loss_rel_change=b, max_output_rel_error=b,
                    tokens_per_step=args.tokens_per_step, verify=counted)
    t_ours = time.perf_counter() - t0
    flops = {c.name: c.flops for c in ours.choices.values()}
    total = sum(flops.values())

    # baseline: every (module, recipe) alone
    t0 = time.perf_counter()
    passes = 0
    single: dict[str, tuple[str, float]] = {}
    for L in r.layers:
        options = []
        for rec in TORCHAO_RECIPES:
            c = layer_cost(args.tokens_per_step, L.in_features, L.out_features, rec, target)
            if not c.pays:
                continue
            loss, oerr = verify({L.name: rec})
            passes += 1
            rel = abs(loss - r.loss_fp32) / abs(r.loss_fp32)
            if rel <= b and oerr.rel_l2 <= b:
                options.append((c.time_s, rec, rel))
        if options:
            _, rec, rel = min(options)
            single[L.name] = (rec, rel)
    chosen, acc = [], 0.0
    for name, (_rec, rel) in sorted(single.items(), key=lambda kv: kv[1][1]):
        if acc + rel <= b:
            chosen.append(name)
            acc += rel
    while chosen:
        loss, oerr = verify({n: single[n][0] for n in chosen})
        passes += 1
        if abs(loss - r.loss_fp32) / abs(r.loss_fp32) <= b and oerr.rel_l2 <= b:
            break
        chosen.pop()
    t_base = time.perf_counter() - t0
    base_share = sum(flops[n] for n in chosen) / total
    ours_share = ours.fp8_flop_share()
    print(f"depth {args.depth}, width {args.width}, {args.tokens} rows audited, costed at {args.tokens_per_step} "
          f"rows per step on {target.name}, budget {b:g}")
    print(f"{'method':<10} {'model runs':>10} {'FP8 FLOP share':>15} {'wall s':>8}  modules in FP8")
    print(f"{'ours':<10} {len(r.recipes) + calls['n']:>10} {ours_share:>15.3f} {t_ours:>8.1f}  "
          f"{dict(sorted(ours.modules.items()))}")
    print(f"{'baseline':<10} {passes:>10} {base_share:>15.3f} {t_base:>8.1f}  "
          f"{ {n: single[n][0] for n in sorted(chosen)} }")
    ratio = ours_share / base_share if base_share else float("inf")
    print(f"ours / baseline FP8 FLOP share: {ratio:.3f} (goal >= 0.95)")


if __name__ == "__main__":
    main()
