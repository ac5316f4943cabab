"""What every record of audit.json shares (precision_audit/record/__init__.py, docs/record.md): the ``Section`` base
class, with the keys of a hand-edited file the record has no field for (``extra``) and the optional keys it left
out (``absent``), and ``_key`` for a field whose JSON key differs from its attribute name.

Its own module so that the record's sections in other modules of the package (record/fp8.py) can derive from it
without importing the package face that gathers them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


#: Field metadata: the JSON key when it differs from the attribute name.
def _key(name: str) -> Any:
    return field(metadata={"key": name})


@dataclass
class Section:
    """What every record shares: the keys of a hand-edited file this version has no field for (``extra``) and
    the optional keys the file left out (``absent``); neither is set by an audit itself."""

    extra: dict[str, Any] = field(default_factory=dict, kw_only=True, repr=False, compare=False,
                                  metadata={"internal": True})
    absent: frozenset[str] = field(default_factory=frozenset, kw_only=True, repr=False, compare=False,
                                   metadata={"internal": True})
