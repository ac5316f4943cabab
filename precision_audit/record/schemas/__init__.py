"""JSON Schemas of the public outputs, shipped beside this module in ``precision_audit/record/schemas/``
(README.md, "Outputs"; docs/policy.md).

Example::

    from precision_audit.record.schemas import validate_audit
    validate_audit(json.load(open("audit/audit.json")))   # raises jsonschema.ValidationError if malformed
"""

from __future__ import annotations

import functools
import json
from importlib.resources import files
from typing import Any

SCHEMA_FILES = {"audit": "audit.schema.json", "policy": "policy.schema.json"}


@functools.cache
def _load(name: str) -> str:
    file = SCHEMA_FILES.get(name, name)
    return files("precision_audit.record.schemas").joinpath(file).read_text(encoding="utf-8")


def load_schema(name: str) -> dict[str, Any]:
    """The parsed schema ``"audit"`` or ``"policy"`` (or a file name in the package); a fresh dict each call."""
    return json.loads(_load(name))


@functools.cache
def _validator(name: str):
    import jsonschema  # imported lazily: only the report and the tests need it

    schema = load_schema(name)
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema)


def validate_audit(doc: Any) -> None:
    """Raise :class:`jsonschema.ValidationError` (the most relevant error) if ``doc`` is not a valid audit.json."""
    _validate("audit", doc)


def validate_policy(doc: Any) -> None:
    """Raise :class:`jsonschema.ValidationError` if ``doc`` is not a valid policy.json (version 1)."""
    _validate("policy", doc)


def _validate(name: str, doc: Any) -> None:
    import jsonschema

    error = jsonschema.exceptions.best_match(_validator(name).iter_errors(doc))
    if error is not None:
        raise error
