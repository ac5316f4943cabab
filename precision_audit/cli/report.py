"""``precision-audit report AUDIT_JSON [--out DIR]``: re-render report.html from a saved audit.json;
``precision-audit report FOLDER|WATCH_JSON [--out DIR]``: the timeline page of a run (timeline.html).

A folder holding audits in sub-folders (``step-<N>/audit.json``, as the trainer callbacks write them) and/or a
``watch.json``, or a watch log itself (schema ``precision-audit/watch``), renders as timeline.html
(precision_audit/report/timeline.py; docs/report.md, "Audits over a run"); every audit is validated as below.

Nothing is re-run: the page is rendered from audit.json (and the policy.json beside it, when there is one),
so it is the same page byte for byte apart from its generation timestamp. Exit codes: 0 written; 2 a user
error (missing or unreadable file, not an audit.json), message only.

audit.json is validated before anything is rendered (precision_audit/record/codec.py, which reads it into
the audit's record): strict JSON (no NaN / Infinity, no number beyond a float, no duplicate key), then its JSON
Schema; the message names the field (``layers[2].calls``). Any schema-valid file renders, extreme numbers
(1e308, 5e-324) shown as they are (docs/report.md).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import AuditError
from ..record.codec import ReportInputError, _read_json, check_audit, load_audit, load_record


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="precision-audit report",
        description="Re-render report.html from a saved audit.json without running the model again. "
                    "The policy shown is the policy.json next to audit.json, when there is one.")
    p.add_argument("audit_json", metavar="AUDIT_JSON",
                   help="an audit.json written by precision-audit; or a folder of audits (step-<N>/audit.json) and/or "
                        "watch.json, or a watch log: the run's timeline (timeline.html)")
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


def _is_watch_log(path: Path) -> bool:
    if not path.is_file() or path.suffix != ".json":
        return False
    try:
        with path.open("rb") as f:
            head = f.read(200)
    except OSError:
        return False
    return b'"precision-audit/watch"' in head


def _step_of(folder: Path, order: int) -> tuple[int, int, str]:
    m = re.fullmatch(r"step-(\d+)", folder.name)
    return (0, int(m.group(1)), "") if m else (1, order, folder.name)


def render_timeline_of(path: Path, out_dir: Path | None = None) -> Path:
    """Render ``timeline.html`` for a folder of audits and/or a watch log (or a watch log file); returns the path."""
    from ..outputs import write_files
    from ..report.timeline import render_timeline

    watch_path = path if path.is_file() else path / "watch.json"
    watch = _read_json(watch_path, "watch log") if watch_path.is_file() else None
    if watch is not None and not (isinstance(watch, dict) and watch.get("schema") == "precision-audit/watch"
                                  and isinstance(watch.get("modules"), dict)):
        raise ReportInputError(f"{watch_path} is not a watch log", expected='"schema": "precision-audit/watch"',
                               hint="pass the watch.json that controller.save_watch or a callback wrote")
    folders = sorted((d for d in path.iterdir() if (d / "audit.json").is_file()), key=lambda d: d.name) \
        if path.is_dir() else []
    ordered = sorted(((_step_of(d, i), d) for i, d in enumerate(folders)), key=lambda t: t[0])
    audits = [(key[1], load_audit(d / "audit.json")) for key, d in ordered]
    if not audits and watch is None:
        raise ReportInputError(f"{path} holds no audit.json in a sub-folder and no watch.json",
                               hint="pass an audit.json, a folder of step-<N>/audit.json, or a watch log")
    out = out_dir if out_dir is not None else (path if path.is_dir() else path.parent)
    (written,) = write_files(out, {"timeline.html": render_timeline(audits, watch)})
    return written


def report_main(argv: Sequence[str]) -> int:
    """Entry point for ``precision-audit report ...`` (``argv`` excludes the word ``report``)."""
    args = _parser().parse_args(list(argv))
    target = Path(args.audit_json)
    out = Path(args.out) if args.out else None
    try:
        if (target.is_dir() and not (target / "audit.json").is_file()) or _is_watch_log(target):
            path = render_timeline_of(target, out)
        else:
            path = render_saved(target / "audit.json" if target.is_dir() else target, out)
    except AuditError as e:
        print(f"precision-audit report: error: {e.message}", file=sys.stderr)
        return e.exit_code
    if not args.quiet:
        print(f"wrote {path}")
    return 0


__all__ = ["ReportInputError", "check_audit", "load_audit", "load_policy_beside", "load_record", "render_saved",
           "report_main"]
