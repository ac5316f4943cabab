"""``precision-audit report`` and ``verify`` on a tampered or hand-edited audit.json (issue 11, class 6).

audit.json is validated before anything is rendered: strict JSON (NaN / Infinity literals, numbers beyond a
float and duplicate keys refused), then the JSON Schema (precision_audit/record/schemas/audit.schema.json). A bad
file exits 2 with one message naming the field path (``layers[1].error``), no traceback, and report.html
beside it is left as it was. Any schema-valid file renders, extreme numbers (1.8e308, 5e-324) shown as such,
with no "inf" or "nan" produced by overflowing arithmetic.

``CASES`` is part of the bad-input catalogue (tests/cli/test_bad_inputs.py). ``test_mutations_*`` replace
fields of a real audit.json with extreme or wrongly typed values: each is refused or renders.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import os
import random
import re
import shutil
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from models import TROUBLE, TROUBLE_BATCH
from precision_audit.cli import main
from precision_audit.cli.report import ReportInputError, check_audit
from precision_audit.record.codec import from_json
from precision_audit.report.html import render_html

BIG = 1.7976931348623157e308  # the largest float
TINY = 5e-324                 # the smallest subnormal
# "inf" or "nan" as a word of the page (the report writes a non-finite value as "inf/NaN", which is allowed)
OVERFLOW = re.compile(r"(?<![\w/.])-?(inf|nan)(?![\w/])", re.I)


def run(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    err, out = io.StringIO(), io.StringIO()
    before = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except Exception:  # what the console script would show
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(before)
    return code, err.getvalue(), out.getvalue()


@pytest.fixture(scope="module")
def good_audit(tmp_path_factory) -> Path:
    """An audit of fp16_trouble with a verify section: every optional section the report draws is present."""
    out = tmp_path_factory.mktemp("good") / "audit"
    code, err, _ = run([TROUBLE, "--batch", TROUBLE_BATCH, "--out", str(out), "-q", "--steps", "0"], out.parent)
    assert code == 0, err
    code, err, _ = run(["verify", TROUBLE, "--batch", TROUBLE_BATCH, "--policy", str(out / "policy.json"),
                        "--steps", "3", "--device", "cpu", "--out", str(out), "-q"], out.parent)
    assert code == 0, err
    assert "verify" in json.loads((out / "audit.json").read_text())
    return out


def _set(doc: Any, path: tuple, value: Any) -> Any:
    d = doc
    for k in path[:-1]:
        d = d[k]
    if value is _DELETE:
        del d[path[-1]]
    else:
        d[path[-1]] = value
    return doc


_DELETE = object()


def edit(*changes: tuple[tuple, Any]) -> Callable[[str], str]:
    """Text -> text: set (or delete) fields of the audit, written back as JSON."""
    def f(text: str) -> str:
        doc = json.loads(text)
        for path, value in changes:
            _set(doc, path, value)
        return json.dumps(doc, indent=1)
    return f


def first_number(literal: str) -> Callable[[str], str]:
    """Text -> text: the summary's fp32 loss written as ``literal`` (NaN, 1e400, ...)."""
    def f(text: str) -> str:
        doc = json.loads(text)
        doc["summary"]["fp32"]["loss"] = "@@"
        return json.dumps(doc, indent=1).replace('"@@"', literal)
    return f


@dataclasses.dataclass(frozen=True)
class Case:
    """A tampered audit.json (``tamper`` maps the good file's text to the bad one) given to ``report``."""

    id: str
    tamper: Callable[[str], str | bytes]
    words: tuple[str, ...]   # the first is on the error line
    policy: Callable[[str], str] | None = None  # tampers policy.json instead, when given


CASES = [
    Case("audit-layers-null-entry", edit((("layers", 1), None)), ("'layers[1]'", "expected: object", "found:    null")),
    Case("audit-layers-a-string", edit((("layers",), "all of them")), ("'layers'", "array", "'all of them'")),
    Case("audit-summary-a-string", edit((("summary",), "fine")), ("'summary'", "object")),
    Case("audit-layer-error-a-string", edit((("layers", 0, "error"), "oops")), ("'layers[0].error'", "object")),
    Case("audit-layer-missing-field", edit((("layers", 2, "activation"), _DELETE)),
         ("'layers[2].activation' is missing",)),
    Case("audit-verdict-missing", edit((("verdict",), _DELETE)), ("'verdict' is missing",)),
    Case("audit-nan-literal", first_number("NaN"), ("holds NaN, which is not JSON", "null")),
    Case("audit-infinity-literal", first_number("-Infinity"), ("holds -Infinity, which is not JSON",)),
    Case("audit-number-beyond-float", first_number("1e400"), ("1e400", "beyond the range of a float")),
    Case("audit-integer-beyond-float", edit((("layers", 0, "calls"), 10 ** 400)),
         ("'layers[0].calls'", "integer too large for a float", "401 digits")),
    Case("audit-integer-of-5000-digits", lambda t: t.replace('"calls": 1', '"calls": 1' + "0" * 5000, 1),
         ("integer literal too long", "5001 digits")),
    Case("audit-unknown-field-nested-900-deep",
         lambda t: t.replace('"memory": {', '"memory": {"deep": ' + '{"x": ' * 900 + "1" + "}" * 900 + ", ", 1),
         ("'memory.deep.x.x.x", "nested more than 64 levels deep")),
    Case("audit-duplicate-key", lambda t: t.replace('"version": 1,', '"version": 1, "version": 1,', 1),
         ("'version' twice",)),
    Case("audit-not-utf8", lambda t: t.encode().replace(b'"mode"', b'"mo\xffde"', 1), ("not UTF-8", "byte")),
    Case("audit-truncated", lambda t: t[: len(t) // 2], ("is not JSON", "line")),
    Case("audit-not-an-object", lambda t: "[1, 2, 3]", ("is not an audit.json", "'array'")),
    Case("audit-version-2", edit((("version",), 2)), ("version 2", "cannot render")),
    Case("audit-budget-a-number", edit((("options", "budget"), 0)), ("'options.budget'", "object")),
    Case("audit-loss-scale-negative", edit((("summary", "fp16", "loss_scale"), -BIG)),
         ("'summary.fp16.loss_scale'", "> 0")),
    Case("audit-batch-shape-a-number", edit((("batch", "tensors", 0, "shape"), 1e308)),
         ("'batch.tensors[0].shape'", "array")),
    Case("audit-verify-curve-a-string", edit((("verify", "curves", "fp32", 0), "low")),
         ("'verify.curves.fp32[0]'", "number or null")),
    Case("audit-cost-time-negative", edit((("layers", 1, "cost", "estimated_step_time_s", "fp16"), -1e308)),
         ("'layers[1].cost.estimated_step_time_s.fp16'", ">= 0")),
    Case("audit-deeply-nested", lambda t: t.replace('"warnings": [', '"warnings": ' + "[" * 100000 + "]" * 100000
                                                    + ', "w2": [', 1), ("nested too deeply",)),
    Case("audit-policy-beside-tampered", lambda t: t, ("policy file", "'model.class'"),
         policy=lambda t: t.replace('"class": "FP16Trouble"', '"class": 7', 1)),
]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _tampered_copy(good: Path, d: Path, case: Case) -> Path:
    folder = d / "audit"
    shutil.copytree(good, folder)
    target = folder / ("policy.json" if case.policy else "audit.json")
    text = target.read_text(encoding="utf-8")
    new = (case.policy or case.tamper)(text)
    if isinstance(new, bytes):
        target.write_bytes(new)
    else:
        target.write_text(new, encoding="utf-8")
    return folder


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_tampered_audit_json_exits_2_naming_the_field(tmp_path, good_audit, case: Case):
    folder = _tampered_copy(good_audit, tmp_path, case)
    before = _snapshot(folder)
    code, err, out = run(["report", str(folder / "audit.json")], tmp_path)
    assert "Traceback" not in err, err
    assert code == 2, f"exit {code}; stderr:\n{err}"
    lines = err.rstrip("\n").splitlines()
    assert lines[0].startswith("precision-audit report: error: ") and case.words[0] in lines[0], err
    assert sum(line.startswith("precision-audit") for line in lines) == 1, err
    for w in case.words[1:]:
        assert w in err, f"{w!r} missing from:\n{err}"
    assert out == ""
    assert _snapshot(folder) == before, "report.html (or anything else) was changed"


def test_verify_refuses_a_tampered_audit_before_training(tmp_path, good_audit):
    """verify adds its result to the audit in --out: a tampered one is refused first (exit 2), nothing written."""
    folder = _tampered_copy(good_audit, tmp_path, CASES[0])
    before = _snapshot(folder)
    code, err, out = run(["verify", TROUBLE, "--batch", TROUBLE_BATCH, "--policy", str(good_audit / "policy.json"),
                          "--steps", "2", "--device", "cpu", "--out", str(folder), "-q"], tmp_path)
    assert "Traceback" not in err, err
    assert code == 2 and "'layers[1]'" in err.splitlines()[0], err
    assert out == "", "no training ran"
    assert _snapshot(folder) == before


# ---------------------------------------------------------------------------------------------------------------
# schema-valid files with extreme numbers render
# ---------------------------------------------------------------------------------------------------------------


def _numeric_paths(doc: Any, path: tuple = ()) -> list[tuple]:
    out = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _numeric_paths(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:3]):
            out += _numeric_paths(v, path + (i,))
    elif isinstance(doc, (int, float)) and not isinstance(doc, bool):
        out.append(path)
    return out


def _valid(doc: dict) -> bool:
    try:
        check_audit(doc)
        return True
    except ReportInputError:
        return False


def _all_set_to(good: dict, value: float) -> tuple[dict, int]:
    """Every number (first 3 items of each list) set to ``value``, except those the schema then refuses
    (fractions <= 1, percentages, scales, int64 counts), which are put back; returns the doc and the count."""
    from precision_audit.record.schemas import _validator

    doc = copy.deepcopy(good)
    changed = set(_numeric_paths(good))
    for p in changed:
        _set(doc, p, value)
    for _ in range(20):
        errors = list(_validator("audit").iter_errors(doc))
        if not errors:
            break
        for e in errors:
            where = tuple(e.absolute_path)
            for p in [p for p in changed if p[:len(where)] == where]:
                _set(doc, p, _get(good, p))
                changed.discard(p)
    else:
        raise AssertionError("could not make a schema-valid extreme audit")
    return doc, len(changed)


def _get(doc: Any, path: tuple) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def test_extreme_numbers_in_every_numeric_field_render_as_such(tmp_path, good_audit):
    """Every number of the audit set to 1.8e308 at once, then to 5e-324 at once (where the schema allows):
    rendered through the CLI, the extreme value shown, no inf/nan from arithmetic."""
    good = json.loads((good_audit / "audit.json").read_text())
    assert len(_numeric_paths(good)) > 200
    for value, shown in ((BIG, "1.80e+308"), (TINY, "4.94e-324")):
        doc, changed = _all_set_to(good, value)
        assert changed > 100, changed
        folder = tmp_path / f"extreme-{shown}"
        folder.mkdir()
        (folder / "audit.json").write_text(json.dumps(doc), encoding="utf-8")
        code, err, out = run(["report", str(folder / "audit.json")], tmp_path)
        assert code == 0 and "Traceback" not in err, err
        html = (folder / "report.html").read_text(encoding="utf-8")
        assert shown in html
        assert not OVERFLOW.findall(html), sorted(set(OVERFLOW.findall(html)))


MUTANTS = [BIG, -BIG, TINY, -TINY, 0, -0.0, 2 ** 63, 10 ** 400, "s", None, {}, [], True]


def _mutants(doc: dict, seed: int, n: int) -> list[tuple[tuple, Any]]:
    every: list[tuple] = []

    def walk(x: Any, p: tuple) -> None:
        if p:
            every.append(p)
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, p + (k,))
        elif isinstance(x, list):
            for i, v in enumerate(x[:2]):
                walk(v, p + (i,))
    walk(doc, ())
    rng = random.Random(seed)
    return [(rng.choice(every), rng.choice(MUTANTS)) for _ in range(n)]


def _check_mutants(good_audit: Path, tmp_path: Path, seed: int, n: int) -> None:
    good = json.loads((good_audit / "audit.json").read_text())
    policy = json.loads((good_audit / "policy.json").read_text())
    baseline = len(OVERFLOW.findall(render_html(from_json(good), policy)))
    rendered = 0
    for path, value in _mutants(good, seed, n):
        doc = _set(copy.deepcopy(good), path, value)
        if not _valid(doc):
            continue
        html = render_html(from_json(doc), policy)  # a crash here fails the test with the path in the traceback
        rendered += 1
        assert len(OVERFLOW.findall(html)) <= baseline, (path, value, OVERFLOW.findall(html)[:5])
    assert rendered > n // 5, rendered


def test_mutations_of_a_real_audit_are_refused_or_render(tmp_path, good_audit):
    _check_mutants(good_audit, tmp_path, seed=0, n=100)


@pytest.mark.slow
def test_many_mutations_of_a_real_audit_are_refused_or_render(tmp_path, good_audit):
    _check_mutants(good_audit, tmp_path, seed=1, n=1000)


def test_catalogue_ids_are_unique():
    """These cases count toward the bad-input catalogue (tests/cli/test_bad_inputs.py); ids must not repeat."""
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 10
