"""record/json_text.py's ``dumps`` writes exactly what ``json.dumps(doc, indent=n, allow_nan=False)`` writes (the
reference: the standard library's own encoder), on random documents and on saved audits, and fails where it fails."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from precision_audit.record.json_text import dumps

_SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2 ** 70), max_value=2 ** 70)
            | st.floats(allow_nan=False, allow_infinity=False)
            | st.sampled_from([0.0, -0.0, 5e-324, 1e16, 1e300, 0.1, 1.0, -2.5e-7])
            | st.text(alphabet=st.characters(), max_size=8) | st.sampled_from(["", "\n", '"\\', "\x00\x1f", "é✓𝄞"]))
_KEYS = st.text(max_size=6) | st.integers(-5, 5) | st.sampled_from([1.5, -0.0, True, False, None])
_DOCS = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                     | st.lists(inner, max_size=3).map(tuple)
                     | st.dictionaries(_KEYS, inner, max_size=4), max_leaves=40)


@settings(max_examples=400, deadline=None)
@given(doc=_DOCS, indent=st.sampled_from([0, 1, 2, 4]))
def test_the_text_is_json_dumps(doc, indent):
    assert dumps(doc, indent) == json.dumps(doc, indent=indent, allow_nan=False)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["top", "flat list", "nested", "key"])
def test_a_float_that_is_not_finite_raises_as_in_json_dumps(bad, where):
    doc = {"top": bad, "flat list": [1, bad], "nested": {"a": [{"b": [bad]}], "c": {}}, "key": {bad: 1}}[where]
    with pytest.raises(ValueError):
        json.dumps(doc, indent=1, allow_nan=False)
    with pytest.raises(ValueError):
        dumps(doc, 1)


@pytest.mark.parametrize("doc", [object(), [1, object()], {"a": {"b": [object()]}}, {(1, 2): 3}, {"a": {(1,): 2}}],
                         ids=["top", "flat list", "nested", "tuple key", "nested tuple key"])
def test_what_json_cannot_hold_raises_type_error(doc):
    with pytest.raises(TypeError):
        json.dumps(doc, indent=1, allow_nan=False)
    with pytest.raises(TypeError):
        dumps(doc, 1)


@pytest.mark.parametrize("name", ["tiny_gpt", "fp16_trouble"])
def test_saved_audits(sample_audits, name):
    _, out, _ = sample_audits.get(name)
    for file, indent in (("audit.json", 1), ("policy.json", 2)):
        doc = json.loads((out / file).read_text())
        assert dumps(doc, indent) + "\n" == (out / file).read_text(), file
