"""audit.json (schema ``precision-audit/audit``): the one place the audit's record (precision_audit/record.py)
becomes JSON and JSON becomes the record again.

:func:`to_json` writes an :class:`~precision_audit.record.AuditRecord` as audit.json's content; :func:`from_json`
validates a parsed audit.json against ``precision_audit/schemas/audit.schema.json`` (through
:func:`precision_audit.cli.report.check_audit`: the message names the field) and reads it back. Floats that are
not finite (an overflowed error metric, say) are written as ``null``; the neighbouring ``nonfinite`` counts say
why. docs/record.md lists the record's types.

Example::

    record = from_json(json.loads(Path("audit/audit.json").read_text()))
    assert to_json(record) == json.loads(Path("audit/audit.json").read_text())
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, Union, cast

from .. import record as R
from ..errors import AuditError

AUDIT_SCHEMA_ID = "precision-audit/audit"
AUDIT_VERSION = 1


def clean(x: Any) -> Any:
    """Make a value JSON-safe: non-finite floats -> None, tuples -> lists, int keys -> str."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x




T = TypeVar("T")


def to_json(value: Any) -> Any:
    """audit.json's content for a record (or any part of it): dataclass fields under their JSON keys, in field
    order; ``extra`` keys after them; ``omit_none`` fields and the keys a read file lacked left out; then
    :func:`clean`."""
    return clean(_plain(value))


def _plain(value: Any) -> Any:
    if isinstance(value, R.Summary):
        return {"fp32": _plain(value.fp32), **{k: _plain(v) for k, v in value.formats.items()},
                **_plain(value.extra)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        absent: frozenset[str] = getattr(value, "absent", frozenset())
        for f in dataclasses.fields(value):
            if f.metadata.get("internal"):
                continue
            key = f.metadata.get("key", f.name)
            v = getattr(value, f.name)
            if v is None and (key in absent or f.metadata.get("omit_none")):
                continue  # left out by the file read, or optional and not set
            out[key] = _plain(v)
        out.update({k: _plain(v) for k, v in getattr(value, "extra", {}).items()})
        return out
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def as_stored(record: R.AuditRecord) -> R.AuditRecord:
    """The record as audit.json stores it: every non-finite float as None (the file's ``null``; the neighbouring
    ``nonfinite`` counts say why), tuples as lists. The report renders this form, so the page the audit writes
    and the one ``precision-audit report`` renders from the saved file are the same (docs/report.md)."""
    return read(R.AuditRecord, to_json(record))


def as_record(audit: R.AuditRecord | Any) -> R.AuditRecord:
    """The record of ``audit``: a record as is, audit.json's content (already validated) read into one."""
    return audit if isinstance(audit, R.AuditRecord) else read(R.AuditRecord, audit)


def from_json(doc: Any, path: str = "audit.json") -> R.AuditRecord:
    """The record of a parsed audit.json, after validating it (strict schema id, version, JSON Schema;
    :class:`~precision_audit.cli.report.ReportInputError` naming the field otherwise)."""
    return read(R.AuditRecord, check_audit(doc, path))


def load_record(path: Path) -> R.AuditRecord:
    """Read, validate and type a saved audit.json (:func:`load_audit`, then :func:`read`)."""
    return read(R.AuditRecord, load_audit(path))


def read(cls: type[T], data: Any) -> T:
    """A record of type ``cls`` from its JSON content, without validation (the content must be schema-valid).

    Keys the record has no field for go to ``extra``, optional keys the content lacks to ``absent``: a read
    record writes back the same content."""
    if cls is R.Summary:
        rest = {k: v for k, v in data.items() if k != "fp32"}
        return R.Summary(fp32=read(R.ReferenceSummary, data["fp32"]),  # type: ignore[return-value]
                         formats={k: read(R.FormatSummary, v) for k, v in rest.items() if isinstance(v, dict)},
                         extra={k: v for k, v in rest.items() if not isinstance(v, dict)})
    hints = _hints(cast(type, cls))
    kwargs: dict[str, Any] = {}
    absent = []
    known = set()
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.metadata.get("internal"):
            continue
        key = f.metadata.get("key", f.name)
        known.add(key)
        if key in data:
            kwargs[f.name] = _value(hints[f.name], data[key])
        else:
            absent.append(key)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                kwargs[f.name] = None
    return cls(**kwargs, extra={k: v for k, v in data.items() if k not in known},  # type: ignore[call-arg]
               absent=frozenset(absent))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _value(tp: Any, v: Any) -> Any:
    """``v`` read as type ``tp``; a value of another shape than ``tp`` (allowed by a looser schema) is kept as is."""
    if v is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        for a in arms:
            if dataclasses.is_dataclass(a) and isinstance(v, dict):
                return read(cast(type, a), v)
        return _value(arms[0], v) if len(arms) == 1 else v
    if dataclasses.is_dataclass(tp):
        return read(cast(type, tp), v) if isinstance(v, dict) else v
    if origin is list and isinstance(v, list):
        (item,) = typing.get_args(tp)
        return [_value(item, x) for x in v]
    if origin is dict and isinstance(v, dict):
        _, item = typing.get_args(tp)
        return {k: _value(item, x) for k, x in v.items()}
    return v


# --- reading audit.json: strict JSON, then the schema ----------------------------------------------------


class ReportInputError(AuditError):
    """The file given to ``precision-audit report`` is not a readable audit.json."""


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
        raise ReportInputError(f"{what} {path} cannot be read",
                               found=f"{type(e).__name__}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ReportInputError(f"{what} {path} is not UTF-8 text",
                               found=f"byte {e.start}: {raw[e.start:e.start + 1]!r}", hint=_FIX) from None
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


def _schema_error(path: Path | str, error: Any) -> ReportInputError:
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
    from .schemas import _validator

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


