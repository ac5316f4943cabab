"""``precision-audit export POLICY --to deepspeed|lightning|accelerate|fsdp|torchao|torchtitan [--out FILE]``.

Writes the nearest equivalent of a policy for another training stack (:mod:`precision_audit.policy.exporters`)
to stdout, or atomically to ``--out``; the generated code loads the policy from its absolute path. What the target
cannot express is written into the output (a ``precision_audit`` key in JSON, a comment block in Python) and, with
``--out``, also listed on stderr.
Strings from the policy reach the output and stderr only through ``repr()`` / ``json.dumps``
(:mod:`precision_audit.policy.exporters`), so a crafted policy cannot inject code or terminal escapes.
User errors raise :class:`~precision_audit.errors.AuditError` subclasses (exit code 2 in the CLI).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..export import EXPORT_TARGETS, export_policy
from ..policy.io import POLICY_FILE, load_policy

DESCRIPTION = """\
Export a precision-audit policy to the settings another training stack reads:
  deepspeed   DeepSpeed config fragment (JSON): the fp16 block (initial_scale_power, loss_scale_window,
              hysteresis, min_loss_scale) or the bf16 block
  lightning   Python: Trainer precision / MixedPrecision plugin with the policy's GradScaler + per-module part
  accelerate  Python: Accelerator(mixed_precision=..., GradScalerKwargs) + per-module part
  fsdp        Python: FSDP MixedPrecision / FSDP2 MixedPrecisionPolicy, per-module units, ShardedGradScaler
  torchao     Python: convert_to_float8_training of the policy's FP8 modules, one config per recipe
  torchtitan  Python for torchtitan 0.3: Float8LinearConverter.Config's recipe_name and filter_fqns (the linears
              kept in high precision)
Each output says what the target cannot express (e.g. DeepSpeed has no per-module formats).
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="precision-audit export", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("policy", metavar="POLICY", help="policy.json written by precision-audit (or its folder)")
    p.add_argument("--to", required=True, choices=EXPORT_TARGETS, help="the training stack to export to")
    p.add_argument("--out", metavar="FILE", help="write here (atomically) instead of stdout")
    return p


def export_main(argv: list[str]) -> int:
    """Run ``precision-audit export`` with ``argv`` (the arguments after ``export``); returns the exit code."""
    args = _parser().parse_args(argv)
    policy = load_policy(args.policy)
    # The generated code loads the policy from this path wherever the training script runs: absolute, not
    # relative to the directory the export ran in (a policy folder stands for its policy.json).
    path = Path(os.path.abspath(args.policy))
    if path.is_dir():
        path = path / POLICY_FILE
    result = export_policy(policy, args.to, policy_path=str(path))
    if args.out:
        from ..policy.io import write_text_atomic

        path = write_text_atomic(args.out, result.text)
        print(f"precision-audit: wrote {args.to} settings to {path}", file=sys.stderr)
        for note in result.notes:
            print(f"  note: {note}", file=sys.stderr)
    else:
        # The same UTF-8 bytes as --out writes, whatever the locale's encoding (the text holds no surrogate:
        # the policy's strings reach it through repr() or json.dumps).
        out = getattr(sys.stdout, "buffer", None)
        if out is not None:
            sys.stdout.flush()
            out.write(result.text.encode("utf-8"))
            out.flush()
        else:  # a replaced sys.stdout (tests' capture, an IDE console) takes text
            sys.stdout.write(result.text)
            sys.stdout.flush()
    return 0
