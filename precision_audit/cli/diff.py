"""``precision-audit diff A B [--json]``: which layers' plan, error (beyond the noise) or headroom changed between two
audits (precision_audit/report/diff.py; docs/report.md, "Comparing two audits").

A and B are audit.json files or folders holding one (an ``--out`` folder, a callback's ``step-<N>/``). Both are
validated as ``precision-audit report`` validates one; a bad file is a user error (exit 2, one message naming it).
Exit code 0 whether or not anything changed.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

from ..errors import OptionError


def _parser() -> argparse.ArgumentParser:
    from ..report.diff import DEFAULT_HEADROOM_BITS, DEFAULT_REL_TOL

    p = argparse.ArgumentParser(
        prog="precision-audit diff",
        description="Compare two audits of a model: the layers whose plan, error (beyond the FP32 noise floor) or "
                    "headroom changed.")
    p.add_argument("a", metavar="A", help="the first audit.json (or a folder holding one)")
    p.add_argument("b", metavar="B", help="the second audit.json (or a folder holding one)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON (schema precision-audit/diff)")
    p.add_argument("--error-tol", type=float, default=DEFAULT_REL_TOL, metavar="FRACTION",
                   help=f"report an error change larger than this fraction of the larger error (default "
                        f"{DEFAULT_REL_TOL:g}; and always larger than twice the FP32 noise floor)")
    p.add_argument("--headroom-bits", type=float, default=DEFAULT_HEADROOM_BITS, metavar="BITS",
                   help=f"report a headroom change of at least this many bits (default {DEFAULT_HEADROOM_BITS:g}; "
                        "a change of sign always)")
    return p


def _audit_path(arg: str) -> Path:
    p = Path(arg)
    return p / "audit.json" if p.is_dir() else p


def diff_main(argv: Sequence[str]) -> int:
    """Entry point for ``precision-audit diff ...`` (``argv`` excludes the word ``diff``)."""
    from ..record.codec import load_audit
    from ..report.diff import diff_audits, diff_table

    args = _parser().parse_args(list(argv))
    for name, v in (("--error-tol", args.error_tol), ("--headroom-bits", args.headroom_bits)):
        if not (math.isfinite(v) and v > 0):
            raise OptionError(f"{name} must be a positive number", found=repr(v))
    pa_, pb = _audit_path(args.a), _audit_path(args.b)
    a, b = load_audit(pa_), load_audit(pb)
    d = diff_audits(a, b, rel_tol=args.error_tol, headroom_bits=args.headroom_bits)
    if args.json:
        print(json.dumps({"a": str(pa_), "b": str(pb), **d}, indent=1))
    else:
        print(diff_table(d, "A", "B"))
    return 0
