"""The strict JSON reader shared by the two files the tool reads back: audit.json (record/codec.py) and
policy.json (policy/io.py). Python's ``json`` takes ``NaN`` and ``Infinity``, lets a later duplicate key win
silently, and reads ``1e400`` as infinity; a file that does any of these was not written by this tool, and its
reader must say so rather than guess.

Each reader turns :class:`NotStrictJSON` into its own user error (a :class:`~precision_audit.errors.PolicyError`,
a ``ReportInputError``) with its own words; everything else (``json.JSONDecodeError``, ``RecursionError``, the
``ValueError`` of an integer literal too long to read) comes from ``json.loads`` as it is.

Example::

    loads('{"a": 1, "a": 2}')   # NotStrictJSON: kind "duplicate", value "a"
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

#: What a strict read refuses: a key twice in one object, a ``NaN`` / ``Infinity`` / ``-Infinity`` constant,
#: a number beyond a float's range.
Kind = Literal["duplicate", "constant", "overflow"]


class NotStrictJSON(Exception):  # not a ValueError: json.loads' callers catch those for its own errors
    """The text is JSON to Python's reader, but not strict JSON: ``kind`` says why, ``value`` is the key, the
    constant's name or the number's text."""

    def __init__(self, kind: Kind, value: str) -> None:
        super().__init__(f"{kind}: {value!r}")
        self.kind = kind
        self.value = value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for k, v in pairs:
        if k in d:
            raise NotStrictJSON("duplicate", k)
        d[k] = v
    return d


def _reject_constant(name: str) -> Any:
    raise NotStrictJSON("constant", name)


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):  # 1e400: Python's json would read it as inf
        raise NotStrictJSON("overflow", text)
    return x


def loads(text: str, *, finite_floats: bool = True) -> Any:
    """``json.loads`` that raises :class:`NotStrictJSON` on a duplicate key, a non-JSON constant, and (with
    ``finite_floats``) a number beyond a float's range."""
    return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant,
                      parse_float=_finite_float if finite_floats else float)
