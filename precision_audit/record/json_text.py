"""audit.json's and policy.json's text: ``json.dumps(doc, indent=n, allow_nan=False)``, the same characters, faster.

The standard library encodes with ``indent`` in pure Python (its C encoder takes no indentation), one generator
step per value: 75 ms of a 770 kB audit.json (a 162-module Llama), more than building the document. Here every
container whose items are all plain scalars (most of them: a module's error sums, its histograms) is encoded by
that C encoder, given the separators of its depth (``",\\n" + indentation``), and only the containers holding
containers are walked in Python, writing what the standard library writes around them (docs/performance.md,
"After the passes"). Strings, numbers and keys are formatted by the same functions as in ``json.dumps``: the
text is the same (tests/record/test_json_text.py compares them on random documents), and a float that is not
finite raises ``ValueError`` as there. No check for circular references: the record is a tree.

Example::

    text = dumps(to_json(record), 1) + "\\n"     # audit.json, as precision_audit/audit.py writes it
"""

from __future__ import annotations

import json
from collections.abc import Callable
from json.encoder import encode_basestring_ascii as _string
from typing import Any, NoReturn

try:
    from json.encoder import c_make_encoder as _c_make_encoder  # type: ignore[attr-defined]  # private, untyped
except ImportError:  # pragma: no cover  (an interpreter without the _json extension)
    _c_make_encoder = None

_SCALARS = frozenset({str, int, float, bool, type(None)})
_INF = float("inf")


def dumps(doc: Any, indent: int) -> str:
    """``json.dumps(doc, indent=indent, allow_nan=False)``'s text (``indent`` spaces a level)."""
    if _c_make_encoder is None:  # pragma: no cover
        return json.dumps(doc, indent=indent, allow_nan=False)
    step = " " * indent
    parts: list[str] = []
    append = parts.append
    encoders: dict[str, Callable[[Any, int], Any]] = {}

    def flat(o: Any, nl: str) -> None:
        """A container of scalars at the depth whose line start is ``nl``: encoded in C, its items one a line."""
        encode = encoders.get(nl)
        if encode is None:
            encode = encoders[nl] = _c_make_encoder(None, _not_serializable, _string, None, ": ", "," + nl + step,
                                                     False, False, False)
        s = "".join(encode(o, 0))
        append(s[0] + nl + step + s[1:-1] + nl + s[-1])

    def walk(o: Any, nl: str) -> None:
        if isinstance(o, dict):
            if not o:
                append("{}")
            elif _SCALARS.issuperset(map(type, o.values())):
                flat(o, nl)
            else:
                inner = nl + step
                sep = "{" + inner
                for k, v in o.items():
                    append(sep + (_string(k) if type(k) is str else _key(k)) + ": ")
                    t = type(v)
                    if t is dict or t is list:
                        walk(v, inner)
                    elif (s := _scalar(v)) is None:
                        walk(v, inner)
                    else:
                        append(s)
                    sep = "," + inner
                append(nl + "}")
        elif isinstance(o, (list, tuple)):
            if not o:
                append("[]")
            elif _SCALARS.issuperset(map(type, o)):
                flat(o, nl)
            else:
                inner = nl + step
                sep = "[" + inner
                for v in o:
                    append(sep)
                    t = type(v)
                    if t is dict or t is list:
                        walk(v, inner)
                    elif (s := _scalar(v)) is None:
                        walk(v, inner)
                    else:
                        append(s)
                    sep = "," + inner
                append(nl + "]")
        else:
            s = _scalar(o)
            if s is None:
                _not_serializable(o)
            append(s)

    walk(doc, "\n")
    return "".join(parts)


def _scalar(o: Any) -> str | None:
    """A scalar's JSON text as ``json.dumps`` writes it (in its order of checks); None for anything else."""
    if isinstance(o, str):
        return _string(o)
    if o is None:
        return "null"
    if o is True:
        return "true"
    if o is False:
        return "false"
    if isinstance(o, int):
        return int.__repr__(o)
    if isinstance(o, float):
        if o != o or o == _INF or o == -_INF:
            raise ValueError("Out of range float values are not JSON compliant: " + repr(o))
        return float.__repr__(o)
    return None


def _key(k: Any) -> str:
    if isinstance(k, str):
        return _string(k)
    if isinstance(k, (int, float)) or k is None:  # bool is an int: "true"/"false", as json.dumps writes them
        return _string(_scalar(k) or "")
    raise TypeError(f"keys must be str, int, float, bool or None, not {k.__class__.__name__}")


def _not_serializable(o: Any) -> NoReturn:
    raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")
