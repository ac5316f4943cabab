"""``precision-audit report AUDIT_JSON [--out DIR]``: re-render report.html from a saved audit.json.

Nothing is re-run: the page is rendered from audit.json (and the policy.json beside it, when there is one),
so it is the same page byte for byte apart from its generation timestamp. Exit codes: 0 written; 2 a user
error (missing or unreadable file, not an audit.json), message only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from .errors import AuditError
from .report.audit_json import AUDIT_SCHEMA_ID, AUDIT_VERSION


class ReportInputError(AuditError):
    """The file given to ``precision-audit report`` is not a readable audit.json."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="precision-audit report",
        description="Re-render report.html from a saved audit.json without running the model again. "
                    "The policy shown is the policy.json next to audit.json, when there is one.")
    p.add_argument("audit_json", metavar="AUDIT_JSON", help="an audit.json written by precision-audit")
    p.add_argument("--out", metavar="DIR", help="folder to write report.html into (default: the folder of AUDIT_JSON)")
    p.add_argument("--quiet", "-q", action="store_true", help="do not print the path written")
    return p


def _read_json(path: Path, what: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ReportInputError(f"{what} {path} not found",
                               hint="pass the audit.json an audit wrote into its --out folder") from None
    except OSError as e:
        raise ReportInputError(f"{what} {path} cannot be read", found=str(e)) from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ReportInputError(f"{what} {path} is not JSON", found=f"line {e.lineno}, column {e.colno}: {e.msg}") from e


def load_audit(path: Path) -> dict[str, Any]:
    """Read and sanity-check an audit.json (schema id and version) for rendering."""
    audit = _read_json(path, "audit file")
    if not isinstance(audit, dict) or audit.get("schema") != AUDIT_SCHEMA_ID:
        found = audit.get("schema") if isinstance(audit, dict) else type(audit).__name__
        raise ReportInputError(f"{path} is not an audit.json", expected=f'"schema": "{AUDIT_SCHEMA_ID}"',
                               found=repr(found), hint="policy.json is not an audit; pass audit.json")
    if audit.get("version") != AUDIT_VERSION:
        raise ReportInputError(f"{path} has audit.json version {audit.get('version')!r}, which this precision-audit "
                               "cannot render", expected=f"version {AUDIT_VERSION}",
                               hint="render it with the precision-audit version that wrote it")
    return audit


def render_saved(audit_path: Path, out_dir: Path | None = None) -> Path:
    """Render ``report.html`` for a saved audit.json into ``out_dir`` (default: its folder); returns the path."""
    from .outputs import write_files
    from .report.html import render_html

    audit = load_audit(audit_path)
    policy_path = audit_path.with_name("policy.json")
    policy = _read_json(policy_path, "policy file") if policy_path.is_file() else None
    out = out_dir if out_dir is not None else audit_path.parent
    html = render_html(audit, policy)
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


__all__ = ["ReportInputError", "load_audit", "render_saved", "report_main"]
