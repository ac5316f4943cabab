"""audit.json (schema ``precision-audit/audit``): the one place the audit's record (precision_audit/record/__init__.py)
becomes JSON and JSON becomes the record again.

:func:`to_json` writes an :class:`~precision_audit.record.AuditRecord` as audit.json's content; :func:`from_json`
validates a parsed audit.json against ``precision_audit/record/schemas/audit.schema.json`` (through
:func:`check_audit`: the message names the field) and reads it back. Floats that are
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
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, Union, cast

from .. import record as R
from .. import strict_json
from ..errors import AuditError
from ..strict_json import NotStrictJSON

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
    return _json(value)


def _json(value: Any) -> Any:
    """``clean(_plain(value))`` in one walk, each record type's fields looked up once (:func:`_write_plan`): the
    report writes the record out once per page (docs/report.md); any other type takes the two-pass path."""
    t = type(value)
    if t is str or t is int or t is bool or value is None:
        return value
    if t is float:
        return value if math.isfinite(value) else None
    if t is dict:
        return {str(k): _json(v) for k, v in value.items()}
    if t is list:
        return [_json(v) for v in value]
    plan = _write_plan(cast(type, t))
    if plan is None:
        return clean(_plain(value))
    out: dict[Any, Any] = {}
    absent: frozenset[str] = getattr(value, "absent", frozenset())
    for name, key, omit_none in plan:
        v = getattr(value, name)
        if v is None and (key in absent or omit_none):
            continue  # left out by the file read, or optional and not set
        out[key] = _json(v)
    extra = getattr(value, "extra", {})
    if extra:
        for k, v in extra.items():
            out[k] = _json(v)
        if not all(type(k) is str for k in out):
            out = {str(k): v for k, v in out.items()}
    return out


@functools.cache
def _write_plan(t: type) -> tuple[tuple[str, str, bool], ...] | None:
    """(attribute, JSON key, omit_none) of each written field of the record type ``t``; None for a type that is
    not a plain record (the summary, an enum, a subclass of dict or list, ...)."""
    if t is R.Summary or not dataclasses.is_dataclass(t) or issubclass(t, (enum.Enum, dict, list, tuple, float)):
        return None
    return tuple((f.name, f.metadata.get("key", f.name), bool(f.metadata.get("omit_none")))
                 for f in dataclasses.fields(t) if not f.metadata.get("internal"))


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
    plan, known = _read_plan(cast(type, cls))
    kwargs: dict[str, Any] = {}
    absent = []
    for name, key, reader, required in plan:
        if key in data:
            v = data[key]
            kwargs[name] = v if reader is None else reader(v)
        else:
            absent.append(key)
            if required:
                kwargs[name] = None
    return cls(**kwargs, extra={k: v for k, v in data.items() if k not in known},  # type: ignore[call-arg]
               absent=frozenset(absent))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


_Reader = Callable[[Any], Any] | None


@functools.cache
def _read_plan(cls: type) -> tuple[tuple[tuple[str, str, _Reader, bool], ...], frozenset[str]]:
    """Per field of ``cls`` that the file holds (not internal): attribute, JSON key, its reader (:func:`_reader`)
    and whether it has no default (None when the file lacks it); and the set of those keys."""
    hints = _hints(cls)
    plan = tuple((f.name, f.metadata.get("key", f.name), _reader(hints[f.name]),
                  f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for f in dataclasses.fields(cls) if not f.metadata.get("internal"))
    return plan, frozenset(key for _, key, _, _ in plan)


@functools.cache
def _reader(tp: Any) -> _Reader:
    """How a value of the type ``tp`` is read, decided once per type: a function of the value, or None where the
    value is kept as it is. A dict read as a record type is that record (:func:`read`; the first record type of
    a union); a list or dict of a type is a new list or dict of its items so read; a value of another shape
    than ``tp`` (allowed by a looser schema) is kept as is; None stays None."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        record = next((cast(type, a) for a in arms if dataclasses.is_dataclass(a)), None)
        rest = _reader(arms[0]) if len(arms) == 1 else None
        return rest if record is None else _record_reader(record, rest)
    if dataclasses.is_dataclass(tp):
        return _record_reader(cast(type, tp), None)
    if origin is list:
        return _list_reader(_reader(typing.get_args(tp)[0]))
    if origin is dict:
        return _dict_reader(_reader(typing.get_args(tp)[1]))
    return None


def _record_reader(record: type, other: _Reader) -> Callable[[Any], Any]:
    def read_record(v: Any) -> Any:
        if isinstance(v, dict):
            return read(record, v)
        return v if other is None or v is None else other(v)

    return read_record


def _list_reader(each: _Reader) -> Callable[[Any], Any]:
    def read_list(v: Any) -> Any:
        if not isinstance(v, list):
            return v
        return list(v) if each is None else [None if x is None else each(x) for x in v]

    return read_list


def _dict_reader(each: _Reader) -> Callable[[Any], Any]:
    def read_dict(v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        return dict(v) if each is None else {k: None if x is None else each(x) for k, x in v.items()}

    return read_dict


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


def _not_strict(e: NotStrictJSON) -> tuple[str, str]:
    """The problem, and its hint, of a file precision_audit/strict_json.py refused."""
    if e.kind == "duplicate":
        return (f"it has the key {_short(e.value)} twice in one object",
                "keep one of them; JSON readers disagree on which one wins")
    if e.kind == "constant":
        return f"it holds {e.value}, which is not JSON", "audit.json writes a non-finite value as null; " + _FIX
    return f"it holds the number {e.value[:40]}, beyond the range of a float (about 1.8e308)", _FIX


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
        return strict_json.loads(text)
    except json.JSONDecodeError as e:
        raise ReportInputError(f"{what} {path} is not JSON", found=f"line {e.lineno}, column {e.colno}: {e.msg}",
                               hint=_FIX) from None
    except NotStrictJSON as e:
        problem, hint = _not_strict(e)
        raise ReportInputError(f"{what} {path} is not valid: {problem}", hint=hint) from None
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
    (precision_audit/record/schemas/audit.schema.json). Raises :class:`ReportInputError` naming the field."""
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


