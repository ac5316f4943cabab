"""report.html: one self-contained page rendered by jinja2 (autoescape on) from the audit's typed record.

The report computes nothing: :mod:`precision_audit.report.view` picks numbers out of the record
(precision_audit/record/__init__.py) and formats them for people, and :mod:`precision_audit.report.charts` draws them.
The record is its only input besides the policy, and ``precision-audit report audit.json`` reads the same record
back from the file (record/codec.py ``from_json``), so it re-renders the same page byte for byte; the one
thing that differs is the generation timestamp in ``<time id="generated">``.

Fields a reader of audit.json cannot count on (per layer ``alignment`` and ``cost``; ``summary.<format>.step_time.
estimated_s``; top-level ``estimates``, ``memory``, ``traces`` and ``verify``; the planner's fields in ``plan``)
are None in the record when absent and replaced by the matching note ("not measured: <why>"); the shapes read
are listed in docs/report.md.

Example::

    record = from_json(json.load(open("audit/audit.json")))
    html = render_html(record, json.load(open("audit/policy.json")))
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import gc
import math
from collections.abc import Iterator, Mapping
from importlib import resources
from typing import Any

import jinja2
from markupsafe import Markup, escape

from ..record import AuditRecord
from . import charts
from .numbers import _label, fmt_bytes, fmt_db, fmt_num, fmt_pct, fmt_scale, fmt_seconds, fmt_value, severity
from .template_cache import template_cache
from .view import BAND_FORMATS, SECTIONS, build_view, given

__all__ = ["BAND_FORMATS", "SECTIONS", "TEMPLATE", "build_view", "fmt_num", "fmt_scale", "generic_html",
           "render_audit_json", "render_html"]

TEMPLATE = "report.html.j2"

def _loader() -> jinja2.BaseLoader:
    root = resources.files("precision_audit.templates")

    def load(name: str) -> str | None:
        f = root.joinpath(name)
        return f.read_text(encoding="utf-8") if f.is_file() else None

    return jinja2.FunctionLoader(load)


# --- generic rendering for fields this version does not know by name ---------------------------------------


def generic_html(value: Any, key: str = "", depth: int = 0) -> Markup:
    """Render a JSON value as HTML: dicts as <dl>, lists of dicts as a table, scalars formatted by key."""
    if isinstance(value, Mapping):
        if not value:
            return Markup('<span class="muted">none</span>')
        rows = [Markup("<dt>{}</dt><dd>{}</dd>").format(_label(str(k)), generic_html(v, str(k), depth + 1))
                for k, v in value.items()]
        return Markup('<dl class="facts">') + Markup("").join(rows) + Markup("</dl>")
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) for v in value) and depth < 4:
        cols: list[str] = []
        for v in value:
            cols += [str(k) for k in v if str(k) not in cols]
        head = Markup("").join(Markup('<th scope="col" title="{}">{}</th>').format(c, _label(c)) for c in cols)
        body = Markup("").join(
            Markup("<tr>") + Markup("").join(Markup("<td>{}</td>").format(fmt_value(c, v.get(c))) for c in cols)
            + Markup("</tr>") for v in value)
        return Markup('<table class="generic"><thead><tr>{}</tr></thead><tbody>{}</tbody></table>').format(head, body)
    return escape(fmt_value(key, value))


def opt(section: Any, name: str, default: Any) -> Any:
    """The template's reading of an optional field: ``default`` when the file left the field out (the record's
    ``absent``), else its value (None for an explicit null, shown as such)."""
    return default if section is None or name in getattr(section, "absent", ()) else getattr(section, name)


# --- rendering --------------------------------------------------------------------------------------------


def _asset(name: str) -> Markup:
    """A CSS or JS file from templates/, inlined verbatim (not parsed as a template)."""
    return Markup(resources.files("precision_audit.templates").joinpath(name).read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=_loader(), autoescape=True, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters.update(num=fmt_num, pct=fmt_pct, db=fmt_db, seconds=fmt_seconds, bytes=fmt_bytes,
                       scale=fmt_scale, value=lambda v, key="": fmt_value(key, v), generic=generic_html, label=_label)
    env.globals.update(severity=severity, isfinite=lambda x: x is not None and math.isfinite(x),
                       series_class=charts.series_class, fmt_value=fmt_value, asset=_asset, given=given, opt=opt)
    env.bytecode_cache = template_cache(env)  # the compiled template, kept between processes
    return env


def render_html(audit: AuditRecord, policy: Mapping[str, Any] | None, generated: _dt.datetime | None = None) -> str:
    """The report page of the audit's record (from the audit, or read back from audit.json by ``from_json``).
    ``policy`` None shows "not available"; ``generated`` defaults to now (UTC).

    The page shows every field of the record, the keys of a hand-edited file it has no field for included (each
    record's ``extra``), so one audit.json renders the same page from the audit and from ``precision-audit
    report``. Everything but the ``<time id="generated">`` element is a function of ``audit`` and ``policy``.
    """
    if not isinstance(audit, AuditRecord):
        raise TypeError(f"render_html takes the audit's record (precision_audit.record.AuditRecord), not "
                        f"{type(audit).__name__}: read a saved audit.json with record.codec.from_json")
    from ..record.codec import to_json

    with _no_cyclic_gc():
        return render_audit_json(to_json(audit), policy, generated)


def render_audit_json(doc: Mapping[str, Any], policy: Mapping[str, Any] | None,
                      generated: _dt.datetime | None = None) -> str:
    """:func:`render_html` of the record whose audit.json content is ``doc`` (``to_json(record)``, not validated:
    a file read from disk goes through ``from_json``). The audit writes audit.json and this page from one ``doc``
    (precision_audit/audit.py); the page reads it without changing it."""
    from ..record.codec import read

    when = (generated or _dt.datetime.now(_dt.timezone.utc)).isoformat(timespec="seconds")
    with _no_cyclic_gc():
        # the record as audit.json stores it (record/codec.py, as_stored): non-finite figures as None, shown as
        # "inf/NaN"
        stored = read(AuditRecord, doc)
        view = build_view(stored, policy)
        return _env().get_template(TEMPLATE).render(a=stored, v=view, policy=policy, generated=when)


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a page is built, and restore it as it was.

    Building the page allocates some hundred thousand short-lived objects, freed by reference counting; each
    burst of allocations would otherwise start collections that walk every object the process holds (the
    audit's model, tensors and record): on a 642-layer record that was ~45% of the rendering time. What the
    page leaves behind is collected as usual once the collector runs again."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
