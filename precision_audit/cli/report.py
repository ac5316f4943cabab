"""``precision-audit report AUDIT_JSON [--out DIR]``: re-render report.html from a saved audit.json.

Nothing is re-run: the page is rendered from audit.json (and the policy.json beside it, when there is one),
so it is the same page byte for byte apart from its generation timestamp. Exit codes: 0 written; 2 a user
error (missing or unreadable file, not an audit.json), message only.

audit.json is validated before anything is rendered (precision_audit/report/audit_json.py, which reads it into
the audit's record): strict JSON (no NaN / Infinity, no number beyond a float, no duplicate key), then its JSON
Schema; the message names the field (``layers[2].calls``). Any schema-valid file renders, extreme numbers
(1e308, 5e-324) shown as they are (docs/report.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import AuditError
from ..report.audit_json import ReportInputError, _read_json, check_audit, load_audit, load_record


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="precision-audit report",
        description="Re-render report.html from a saved audit.json without running the model again. "
                    "The policy shown is the policy.json next to audit.json, when there is one.")
    p.add_argument("audit_json", metavar="AUDIT_JSON", help="an audit.json written by precision-audit")
    p.add_argument("--out", metavar="DIR", help="folder to write report.html into (default: the folder of AUDIT_JSON)")
    p.add_argument("--quiet", "-q", action="store_true", help="do not print the path written")
    return p


def load_policy_beside(path: Path) -> dict[str, Any] | None:
    """The policy.json next to ``path`` (validated as a policy), or None when there is none."""
    from ..errors import PolicyError
    from ..policy.schema import Policy

    policy_path = path.with_name("policy.json")
    if not policy_path.is_file():
        return None
    doc = _read_json(policy_path, "policy file")
    try:
        Policy.from_dict(doc)
    except PolicyError as e:
        raise ReportInputError(f"the policy file {policy_path} beside the audit is not valid: {e.problem}",
                               expected=e.expected, found=e.found,
                               hint="fix or remove it (the report then shows no policy), or re-run the audit") from None
    return doc


def render_saved(audit_path: Path, out_dir: Path | None = None) -> Path:
    """Render ``report.html`` for a saved audit.json into ``out_dir`` (default: its folder); returns the path."""
    from ..outputs import write_files
    from ..report.html import render_html

    record = load_record(audit_path)
    policy = load_policy_beside(audit_path)
    out = out_dir if out_dir is not None else audit_path.parent
    html = render_html(record, policy)
    (written,) = write_files(out, {"report.html": html})
    return written


def report_main(argv: Sequence[str]) -> int:
    """Entry point for ``precision-audit report ...`` (``argv`` excludes the word ``report``)."""
    args = _parser().parse_args(list(argv))
    try:
        path = render_saved(Path(args.audit_json), Path(args.out) if args.out else None)
    except AuditError as e:
        print(f"precision-audit report: error: {e.message}", file=sys.stderr)
        return e.exit_code
    if not args.quiet:
        print(f"wrote {path}")
    return 0


__all__ = ["ReportInputError", "check_audit", "load_audit", "load_policy_beside", "load_record", "render_saved",
           "report_main"]
