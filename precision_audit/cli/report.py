"""``precision-audit report AUDIT_JSON [--out DIR]``: re-render report.html from a saved audit.json.

Nothing is re-run: the page is rendered from audit.json (and the policy.json beside it, when there is one),
so it is the same page byte for byte apart from its generation timestamp. Exit codes: 0 written; 2 a user
error (missing or unreadable file, not an audit.json), message only.

audit.json is validated before anything is rendered: strict JSON (no NaN / Infinity, no number beyond a
float, no duplicate key), then its JSON Schema; the message names the field (``layers[2].calls``). Any
schema-valid file renders, extreme numbers (1e308, 5e-324) shown as they are (docs/report.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from ..errors import AuditError
from ..report.audit_json import AUDIT_SCHEMA_ID, AUDIT_VERSION


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


_FIX = "re-run the audit to write it again, or restore the audit.json the audit wrote"


def _json_type(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", dict: "object", list: "array",
            type(None): "null"}.get(type(v), type(v).__name__)


def _short(v: Any) -> str:
    text = repr(v)  # repr: quotes and escapes, so a crafted value cannot add lines or terminal escapes
    return text if len(text) <= 60 else text[:57] + "..."


def _field(path: Any) -> str:
    """A JSON path as people write it: ``layers[2].error.fp16``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(document)"


def _reject_constant(name: str) -> Any:
    raise ReportInputError(f"it holds {name}, which is not JSON",
                           hint="audit.json writes a non-finite value as null; " + _FIX)


def _parse_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):  # 1e400: Python's json would read it as inf
        raise ReportInputError(f"it holds the number {text[:40]}, beyond the range of a float (about 1.8e308)",
                               hint=_FIX)
    return x


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for k, v in pairs:
        if k in d:
            raise ReportInputError(f"it has the key {_short(k)} twice in one object",
                                   hint="keep one of them; JSON readers disagree on which one wins")
        d[k] = v
    return d


#: Deeper nesting than this is refused (an audit is about 8 deep; the report renders unknown fields recursively).
MAX_DEPTH = 64


def _out_of_range(doc: Any) -> tuple[tuple, str, str] | None:
    """The first value the report cannot handle that JSON Schema does not see: an integer too large for a float
    (the report computes with floats), or nesting deeper than :data:`MAX_DEPTH`. (path, problem, found)."""
    stack: list[tuple[tuple, Any]] = [((), doc)]
    while stack:
        p, v = stack.pop()
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > sys.float_info.max:
            return p, "is an integer too large for a float", f"{len(str(abs(v)))} digits"
        if isinstance(v, (dict, list)) and len(p) >= MAX_DEPTH:
            return p, f"is nested more than {MAX_DEPTH} levels deep", _json_type(v)
        if isinstance(v, dict):
            stack += [(p + (k,), x) for k, x in reversed(v.items())]
        elif isinstance(v, list):
            stack += [(p + (i,), x) for i, x in reversed(list(enumerate(v)))]
    return None


def _read_json(path: Path, what: str) -> Any:
    """Strict JSON: no NaN / Infinity, no number beyond a float, no duplicate key; errors name the place."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ReportInputError(f"{what} {path} not found",
                               hint="pass the audit.json an audit wrote into its --out folder") from None
    except OSError as e:
        raise ReportInputError(f"{what} {path} cannot be read", found=f"{type(e).__name__}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ReportInputError(f"{what} {path} is not UTF-8 text", found=f"byte {e.start}: {raw[e.start:e.start + 1]!r}",
                               hint=_FIX) from None
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_parse_float,
                          object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise ReportInputError(f"{what} {path} is not JSON", found=f"line {e.lineno}, column {e.colno}: {e.msg}",
                               hint=_FIX) from None
    except ReportInputError as e:
        raise ReportInputError(f"{what} {path} is not valid: {e.problem}", hint=e.hint) from None
    except RecursionError:
        raise ReportInputError(f"{what} {path} is nested too deeply to be an audit", hint=_FIX) from None
    except ValueError as e:  # an integer literal of more than 4300 digits (sys.get_int_max_str_digits())
        raise ReportInputError(f"{what} {path} is not valid: it holds an integer literal too long to read",
                               found=str(e).split(":")[-1].split(";")[0].strip()[:80], hint=_FIX) from None


def _schema_error(path: Path, error: Any) -> ReportInputError:
    """One message for the most relevant JSON Schema error: the field's path, what it must be, what it is."""
    field = list(error.absolute_path)
    v, value, inst = error.validator, error.validator_value, error.instance
    expected = None
    if v == "required":
        missing = next((k for k in value if isinstance(inst, dict) and k not in inst), value[0])
        return ReportInputError(f"{path} is not a valid audit.json: field '{_field(field + [missing])}' is missing",
                                hint=_FIX)
    if v == "type":
        types = value if isinstance(value, list) else [value]
        expected = " or ".join(types)
    elif v in ("enum", "const"):
        expected = "one of " + ", ".join(map(json.dumps, value)) if v == "enum" else json.dumps(value)
    elif v in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        expected = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}[v] + f" {value}"
    else:
        message = error.message
        expected = message if len(message) <= 120 else message[:117] + "..."
    return ReportInputError(f"{path} is not a valid audit.json: field '{_field(field)}' has a wrong value",
                            expected=expected, found="null" if inst is None else f"{_json_type(inst)} {_short(inst)}",
                            hint=_FIX)


def load_audit(path: Path) -> dict[str, Any]:
    """Read and validate an audit.json for rendering: strict JSON, schema id and version, then the JSON Schema
    (precision_audit/schemas/audit.schema.json). Raises :class:`ReportInputError` naming the field."""
    return check_audit(_read_json(path, "audit file"), path)


def check_audit(audit: Any, path: Path | str = "audit.json") -> dict[str, Any]:
    """Validate a parsed audit.json (what :func:`load_audit` does after reading); returns it.

    Raises :class:`ReportInputError` naming the field: not an audit, another version, an integer beyond a
    float, or a JSON Schema violation (the most relevant one)."""
    from ..report.schemas import _validator

    if not isinstance(audit, dict) or audit.get("schema") != AUDIT_SCHEMA_ID:
        found = audit.get("schema") if isinstance(audit, dict) else _json_type(audit)
        raise ReportInputError(f"{path} is not an audit.json", expected=f'"schema": "{AUDIT_SCHEMA_ID}"',
                               found=_short(found), hint="policy.json is not an audit; pass audit.json")
    if audit.get("version") != AUDIT_VERSION:
        raise ReportInputError(f"{path} has audit.json version {_short(audit.get('version'))}, which this "
                               "precision-audit cannot render", expected=f"version {AUDIT_VERSION}",
                               hint="render it with the precision-audit version that wrote it")
    bad = _out_of_range(audit)
    if bad is not None:
        raise ReportInputError(f"{path} is not a valid audit.json: field '{_field(bad[0])}' {bad[1]}",
                               found=bad[2], hint=_FIX)
    import jsonschema

    error = jsonschema.exceptions.best_match(_validator("audit").iter_errors(audit))
    if error is not None:
        raise _schema_error(path, error)
    return audit


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

    audit = load_audit(audit_path)
    policy = load_policy_beside(audit_path)
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


__all__ = ["ReportInputError", "check_audit", "load_audit", "load_policy_beside", "render_saved", "report_main"]
