"""``precision-audit verify MODEL --batch BATCH --policy POLICY [--steps N] [--out DIR]``: A/B short training.

Trains N steps from the same initial weights under FP32, under the policy (and, when the policy has an ``fp8``
key, under the policy with its FP8 modules converted through torchao: docs/fp8.md, "verify"), and under plain BF16
and FP16 autocast, and records the loss curves and the final divergence in ``--out``/audit.json (section ``verify``)
and its report; without an audit.json there, it writes ``--out``/verify.json.

Exit codes: 0 the policy arm trained; 1 it failed ("unsafe": it raised, or its final loss or parameters
are not finite; the plain BF16 / FP16 arms failing is only reported); 2 a user error, including an
audit.json in ``--out`` that is not valid (checked before training).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..record import AuditRecord



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
    from ..audit import SubjectRun
    from ..hardware import detect
    from ..loading import load_batch, load_model
    from ..outputs import check_out_dir, write_files
    from ..policy.io import load_policy
    from ..record.codec import to_json
    from ..report.terminal import Progress
    from ..run_setup import resolve_device
    from ..verify import VerifyOptions, run_verify

    opts = VerifyOptions(steps=args.steps, lr=args.lr, optimizer=args.optimizer, seed=args.seed)
    out = Path(args.out)
    check_out_dir(out)
    # The audit the result is added to is validated before any training (docs/report.md): a tampered
    # audit.json is refused with exit 2 naming the field, not found broken after the run.
    audit_path = out / "audit.json"
    record: AuditRecord | None = None
    pol = None
    if audit_path.is_file():
        from ..record.codec import load_record
        from .report import load_policy_beside

        record, pol = load_record(audit_path), load_policy_beside(audit_path)
    policy = load_policy(args.policy)
    model, source = load_model(args.model)
    policy.check_model(model)
    batch = load_batch(args.batch, model, source)
    # the device and the loss are resolved as the audit resolves them (precision_audit/options.py, audit.py)
    device, mode = resolve_device(args.device, False, detect())
    run = SubjectRun(source, batch, device)
    with Progress(quiet=args.quiet) as progress:
        result = run_verify(model, run.forward, run.loss_of, policy, device, mode, opts, progress)
    result.loss = run.loss_facts()
    files: dict[str, str | bytes] = {}
    if record is not None:
        record.verify = result  # the record's typed ``verify`` section (precision_audit/record/__init__.py)
        files["audit.json"] = json.dumps(to_json(record), indent=1, allow_nan=False) + "\n"
        from ..report.html import render_html

        files["report.html"] = render_html(record, pol)
    else:
        files["verify.json"] = json.dumps(to_json(result), indent=1, allow_nan=False) + "\n"
    written = write_files(out, files)
    for arm, curve in result.curves.items():
        last = curve[-1] if curve else None
        rel = result.final_loss_rel_change.get(arm)
        print(f"  {arm:<7} final loss {last if last is not None else 'inf/NaN'}"
              + (f"  (vs fp32: {rel:.2e})" if rel is not None else "")
              + (f"  skipped steps {result.skipped_steps.get(arm, 0)}" if result.skipped_steps.get(arm) else "")
              + (f"  FAILED: {result.errors[arm]}" if arm in result.errors else ""))
    print(f"  wrote: {', '.join(str(f) for f in written)}")
    if result.policy_failure:
        # A failed policy arm is a result, not a crash: "unsafe", exit 1 (docs/report.md).
        print(f"  unsafe: {result.policy_failure}")
        return 1
    return 0
