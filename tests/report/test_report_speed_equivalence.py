"""The cheaper report (issue 14) renders the same page and reads/writes the same record as before.

``to_json`` and ``read`` look each record type's fields up once (record/codec.py ``_write_plan``,
``_read_plan``, ``_reader``) and ``given`` reads a section's own fields instead of writing it out
(report/picks.py). The references below are the walks they replace, kept here verbatim as the independent
answer: every stored audit.json (tests/golden/) and a record holding what only a fresh audit holds (non-finite
floats, tuples, an enum, int keys, unset ``omit_none`` fields) must give the same JSON, the same record (its
``extra`` and ``absent`` too, which dataclass equality skips) and the same ``given`` answers. The caches must
not carry anything from one page to the next: rendering the same record before and after another one gives
the same bytes.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import enum
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, Union

import pytest

from precision_audit import record as R
from precision_audit.record.codec import as_stored, from_json, read, to_json
from precision_audit.report.html import render_html
from precision_audit.report.picks import given

GOLDEN = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists()) / "tests" / "golden"
FILES = sorted(GOLDEN.glob("*.audit.json"))
WHEN = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)


# --- the walks as they were (the reference) ----------------------------------------------------------------


def ref_clean(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): ref_clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [ref_clean(v) for v in x]
    return x


def ref_plain(value: Any) -> Any:
    if isinstance(value, R.Summary):
        return {"fp32": ref_plain(value.fp32), **{k: ref_plain(v) for k, v in value.formats.items()},
                **ref_plain(value.extra)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        absent = getattr(value, "absent", frozenset())
        for f in dataclasses.fields(value):
            if f.metadata.get("internal"):
                continue
            key = f.metadata.get("key", f.name)
            v = getattr(value, f.name)
            if v is None and (key in absent or f.metadata.get("omit_none")):
                continue
            out[key] = ref_plain(v)
        out.update({k: ref_plain(v) for k, v in getattr(value, "extra", {}).items()})
        return out
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: ref_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [ref_plain(v) for v in value]
    return value


def ref_to_json(value: Any) -> Any:
    return ref_clean(ref_plain(value))


def ref_read(cls: Any, data: Any) -> Any:
    if cls is R.Summary:
        rest = {k: v for k, v in data.items() if k != "fp32"}
        return R.Summary(fp32=ref_read(R.ReferenceSummary, data["fp32"]),
                         formats={k: ref_read(R.FormatSummary, v) for k, v in rest.items() if isinstance(v, dict)},
                         extra={k: v for k, v in rest.items() if not isinstance(v, dict)})
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    absent, known = [], set()
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        key = f.metadata.get("key", f.name)
        known.add(key)
        if key in data:
            kwargs[f.name] = ref_value(hints[f.name], data[key])
        else:
            absent.append(key)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                kwargs[f.name] = None
    return cls(**kwargs, extra={k: v for k, v in data.items() if k not in known}, absent=frozenset(absent))


def ref_value(tp: Any, v: Any) -> Any:
    if v is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        for a in arms:
            if dataclasses.is_dataclass(a) and isinstance(v, dict):
                return ref_read(a, v)
        return ref_value(arms[0], v) if len(arms) == 1 else v
    if dataclasses.is_dataclass(tp):
        return ref_read(tp, v) if isinstance(v, dict) else v
    if origin is list and isinstance(v, list):
        (item,) = typing.get_args(tp)
        return [ref_value(item, x) for x in v]
    if origin is dict and isinstance(v, dict):
        _, item = typing.get_args(tp)
        return {k: ref_value(item, x) for k, x in v.items()}
    return v


# --- helpers -----------------------------------------------------------------------------------------------


def same(a: Any, b: Any, path: str = "record") -> None:
    """Deep equality of two read records, ``extra`` and ``absent`` included, and containers of the same type
    (a list stays a list, a dict a dict)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{path}: {a!r} != {b!r}"


def sections(x: Any) -> typing.Iterator[Any]:
    """Every record (dataclass instance) inside ``x``."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        yield x
        for f in dataclasses.fields(x):
            yield from sections(getattr(x, f.name))
    elif isinstance(x, dict):
        for v in x.values():
            yield from sections(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from sections(v)


class Colour(enum.Enum):
    RED = "red"


def fresh_like(doc: dict[str, Any]) -> R.AuditRecord:
    """A record holding what only an audit in memory holds: inf and NaN figures, tuples, an enum, an int key,
    an ``omit_none`` field left unset and not marked absent."""
    rec = read(R.AuditRecord, copy.deepcopy(doc))
    L = rec.layers[0]
    L.activation.amax = math.inf
    L.activation.exponent_histogram = {-3: 5, 2: 7}
    e = next(iter(L.error.values()))
    e.local.rel_l2, e.local.sqnr_db = math.nan, -math.inf
    rec.formats = tuple(rec.formats)
    rec.extra["colour"] = Colour.RED
    rec.extra["shape"] = (2, (3, 4.5, math.inf))
    rec.fp8 = None
    rec.absent = frozenset()  # as an audit builds it: fp8 unset, not read from a file
    return rec


# --- the tests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name.split(".")[0])
def test_to_json_and_read_give_what_the_reference_walks_give(path):
    doc = json.loads(path.read_text())
    rec = from_json(doc)
    same(rec, ref_read(R.AuditRecord, doc))
    assert to_json(rec) == ref_to_json(rec) == doc
    assert json.dumps(to_json(rec)) == json.dumps(ref_to_json(rec))  # the same key order too
    fresh = fresh_like(doc)
    out = to_json(fresh)
    assert json.dumps(out) == json.dumps(ref_to_json(fresh))
    assert out["layers"][0]["activation"]["amax"] is None and out["shape"] == [2, [3, 4.5, None]]
    assert "fp8" not in out and out["colour"] == "red"
    same(as_stored(fresh), ref_read(R.AuditRecord, ref_to_json(fresh)))


def test_read_copies_the_files_lists_and_maps():
    """The record owns its containers: changing it leaves the parsed file as it was (as the reference did)."""
    doc = json.loads(FILES[0].read_text())
    before = copy.deepcopy(doc)
    rec = read(R.AuditRecord, doc)
    rec.formats.append("xx")
    rec.layers.clear()
    rec.options.budget and rec.options.budget.clear()
    assert doc == before


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name.split(".")[0])
def test_given_is_whether_the_section_writes_a_key(path):
    doc = json.loads(path.read_text())
    found = 0
    for rec in (from_json(doc), fresh_like(doc)):
        for s in sections(rec):
            if isinstance(s, R.Section):
                assert given(s) == bool(ref_to_json(s)), type(s).__name__
                found += 1
    empty = read(R.LayerCost, {})
    assert not given(empty) and given(read(R.LayerCost, {"hand_added": 1})) and not given(None)
    assert found > 100


def test_pages_do_not_depend_on_what_was_rendered_before():
    docs = [json.loads(p.read_text()) for p in FILES]
    first = render_html(from_json(docs[0]), None, WHEN)
    for d in docs[1:]:
        render_html(from_json(d), {"version": 1}, WHEN)
    assert render_html(from_json(docs[0]), None, WHEN) == first
    fresh = fresh_like(docs[0])
    assert render_html(fresh, None, WHEN) == render_html(read(R.AuditRecord, ref_to_json(fresh)), None, WHEN)


def test_rendering_leaves_the_garbage_collector_as_it_found_it():
    import gc

    doc = json.loads(FILES[0].read_text())
    assert gc.isenabled()
    render_html(from_json(doc), None, WHEN)
    assert gc.isenabled()
    gc.disable()
    try:
        render_html(from_json(doc), None, WHEN)
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(TypeError):  # raised while the page is built: the policy is not JSON
        render_html(from_json(doc), {"x": object()}, WHEN)
    assert gc.isenabled()
