"""``precision-audit verify MODEL --batch BATCH --policy POLICY [--steps N] [--out DIR]``: A/B short training.

Trains N steps from the same initial weights under FP32, under the policy, and under plain BF16 and FP16
autocast, and records the loss curves and the final divergence in ``--out``/audit.json (section ``verify``)
and its report; without an audit.json there, it writes ``--out``/verify.json.

Exit codes: 0 the policy arm trained; 1 it failed ("unsafe": it raised, or its final loss or parameters
are not finite; the plain BF16 / FP16 arms failing is only reported); 2 a user error, including an
audit.json in ``--out`` that is not valid (checked before training).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from ..errors import OptionError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="precision-audit verify",
                                description="Train a few steps under FP32, the policy, plain BF16 and plain FP16 "
                                            "from the same weights and compare the loss curves.")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--batch", metavar="BATCH")
    p.add_argument("--policy", metavar="POLICY", required=True, help="policy.json (or the folder holding it)")
    p.add_argument("--steps", type=int, default=20, help="training steps per arm (default 20)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="optimizer (default adam)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--out", metavar="DIR", default="audit", help="folder of the audit to add the result to")
    p.add_argument("--quiet", "-q", action="store_true")
    return p


def verify_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from ..loading import load_batch, load_model, resolve_loss
    from ..outputs import check_out_dir, write_files
    from ..policy.io import load_policy
    from ..report.terminal import Progress
    from ..verify import VerifyOptions, run_verify

    opts = VerifyOptions(steps=args.steps, lr=args.lr, optimizer=args.optimizer, seed=args.seed)
    out = Path(args.out)
    check_out_dir(out)
    # The audit the result is added to is validated before any training (docs/report.md): a tampered
    # audit.json is refused with exit 2 naming the field, not found broken after the run.
    audit_path = out / "audit.json"
    audit = pol = None
    if audit_path.is_file():
        from .report import load_audit, load_policy_beside

        audit, pol = load_audit(audit_path), load_policy_beside(audit_path)
    policy = load_policy(args.policy)
    model, source = load_model(args.model)
    policy.check_model(model)
    batch = load_batch(args.batch, model, source)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise OptionError("--device cuda was asked for, but torch sees no CUDA GPU", hint="use --device cpu")
    device = "cuda" if (args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())) else "cpu"
    mode = "cuda" if device == "cuda" else "emulated"
    run_batch = batch.to(device)
    box: dict[str, Any] = {}

    def forward(m):
        return m(*run_batch.args, **run_batch.kwargs)

    def loss_of(o):
        if "spec" not in box:
            box["spec"] = resolve_loss(source, o, run_batch)
        return box["spec"](o, run_batch)

    with Progress(quiet=args.quiet) as progress:
        result = run_verify(model, forward, loss_of, policy, device, mode, opts, progress)
    result["loss"] = {"kind": str(box["spec"].kind), "description": box["spec"].description} if box else None
    files: dict[str, str] = {}
    if audit is not None:
        audit["verify"] = result
        files["audit.json"] = json.dumps(audit, indent=1, allow_nan=False) + "\n"
        from ..report.html import render_html

        files["report.html"] = render_html(audit, pol)
    else:
        files["verify.json"] = json.dumps(result, indent=1, allow_nan=False) + "\n"
    written = write_files(out, files)
    for arm, curve in result["curves"].items():
        last = curve[-1] if curve else None
        rel = result["final_loss_rel_change"].get(arm)
        print(f"  {arm:<7} final loss {last if last is not None else 'inf/NaN'}"
              + (f"  (vs fp32: {rel:.2e})" if rel is not None else "")
              + (f"  skipped steps {result['skipped_steps'].get(arm, 0)}" if result["skipped_steps"].get(arm) else "")
              + (f"  FAILED: {result['errors'][arm]}" if arm in result["errors"] else ""))
    print(f"  wrote: {', '.join(str(f) for f in written)}")
    if result["policy_failure"]:
        # A failed policy arm is a result, not a crash: "unsafe", exit 1 (docs/report.md).
        print(f"  unsafe: {result['policy_failure']}")
        return 1
    return 0
