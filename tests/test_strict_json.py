"""precision_audit/strict_json.py: the one strict JSON reader behind audit.json and policy.json (issue 34)."""

from __future__ import annotations

import json

import pytest

from precision_audit import strict_json
from precision_audit.strict_json import NotStrictJSON


@pytest.mark.parametrize("text, kind, value", [
    ('{"a": 1, "a": 2}', "duplicate", "a"),
    ('{"x": {"b": 1, "b": 1}}', "duplicate", "b"),
    ('[NaN]', "constant", "NaN"),
    ('{"x": -Infinity}', "constant", "-Infinity"),
    ('[1e400]', "overflow", "1e400"),
], ids=["duplicate", "nested-duplicate", "nan", "minus-infinity", "overflow"])
def test_what_python_json_takes_and_a_strict_reader_refuses(text, kind, value):
    json.loads(text)  # Python's own reader takes every one of them
    with pytest.raises(NotStrictJSON) as e:
        strict_json.loads(text)
    assert (e.value.kind, e.value.value) == (kind, value)


def test_the_largest_float_is_read_and_overflow_can_be_left_to_the_caller():
    assert strict_json.loads("[1.7976931348623157e308]") == [1.7976931348623157e308]
    assert strict_json.loads("[1e400]", finite_floats=False) == [float("inf")]


def test_plain_json_reads_as_python_reads_it_and_syntax_errors_stay_json_errors():
    text = '{"a": [1, 2.5, "x", null, true], "b": {"c": -0.0}}'
    assert strict_json.loads(text) == json.loads(text)
    with pytest.raises(json.JSONDecodeError):
        strict_json.loads('{"a": }')
    assert not issubclass(NotStrictJSON, ValueError)  # the readers' `except ValueError` is for json's own errors
