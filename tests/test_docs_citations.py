"""Issue 13 item 6: the code cites the project's own docs, and those docs hold what the code says they hold.

- nothing shipped in the package (code, schemas, templates) cites a file outside the repository (the design
  notes, the style notes or the numerics fact sheet the project grew from);
- every ``docs/<page>.md`` the package cites exists;
- docs/gpus.md has a row for every target GPU with the table's own SM count and peaks (the page the table's
  comments cite, so it must not drift from the code);
- docs/architecture.md names every top-level section of audit.json (from the stored sample audits).
"""

from __future__ import annotations

import json
import re

import pytest

from conftest import ROOT
from precision_audit.gpus import GPUS

PACKAGE = ROOT / "precision_audit"
SHIPPED = [p for p in sorted(PACKAGE.rglob("*"))
           if p.suffix in {".py", ".json", ".cpp"} and "__pycache__" not in p.parts]
SHIPPED += sorted((ROOT / "templates").glob("*.*"))
OUTSIDE = re.compile(r"DESIGN(\.md| §)|NUMERICS|STYLE\.md|reference/|\.\./shared")


def test_the_package_cites_no_file_outside_the_repository():
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in SHIPPED
            for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if OUTSIDE.search(line)]
    assert not hits, "cite docs/... instead:\n" + "\n".join(hits)


def test_every_cited_docs_page_exists():
    cited = {m for p in SHIPPED for m in re.findall(r"docs/([\w-]+\.md)", p.read_text(encoding="utf-8",
                                                                                    errors="replace"))}
    assert cited, "the package cites no docs page at all: the pattern is wrong"
    missing = sorted(c for c in cited if not (ROOT / "docs" / c).is_file())
    assert not missing, f"cited but not in docs/: {missing}"


@pytest.mark.parametrize("gpu", GPUS, ids=[g.key for g in GPUS])
def test_docs_gpus_page_matches_the_table(gpu):
    text = (ROOT / "docs" / "gpus.md").read_text(encoding="utf-8")
    row = next((ln for ln in text.splitlines() if f"(`{gpu.key}`)" in ln), None)
    assert row is not None, f"docs/gpus.md has no row for {gpu.key}"
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]}"
    assert cells[2] == str(gpu.sms)
    peaks = [gpu.peak_tflops[f] for f in ("fp32", "tf32", "bf16", "fp16", "fp8_e4m3")]
    assert cells[4] == " / ".join("—" if v is None else f"{v:g}" for v in peaks)
    assert cells[5] == gpu.confidence


def test_architecture_page_names_every_audit_json_section():
    sections = set()
    for f in sorted((ROOT / "tests" / "golden").glob("*.audit.json")):
        sections |= set(json.loads(f.read_text(encoding="utf-8")))
    assert sections, "no stored audit.json under tests/golden"
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = page[page.index("## Where each audit.json section comes from"):]
    missing = sorted(s for s in sections if f"`{s}`" not in table)
    assert not missing, f"docs/architecture.md does not say where these audit.json sections come from: {missing}"


#: A package path as the docs and docstrings cite it: ``precision_audit/capture/session.py``, or relative to the
#: package (``capture/session.py``, ``options.py`` is not matched: a bare module name is ambiguous).
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
CITED_PATH = re.compile(r"(?<![\w/.-])(?:precision_audit/)?((?:" + "|".join(SUBPACKAGES) + r")/[\w/]+\.(?:py|cpp)"
                        r"|precision_audit/[\w]+\.py)")


def _cited_paths(text: str) -> set[str]:
    return {m.removeprefix("precision_audit/") for m in CITED_PATH.findall(text)}


def test_the_path_pattern_sees_both_spellings():
    assert _cited_paths("see precision_audit/capture/session.py and capture/noise.py, precision_audit/audit.py; "
                        "not tests/capture/test_x.py") == {"capture/session.py", "capture/noise.py", "audit.py"}


def test_every_package_file_the_docs_and_docstrings_cite_exists():
    """Issue 34: a doc or docstring that names a moved file is updated with the move. Scans docs/, README.md and
    pyproject.toml and every module of the package (docstrings and comments)."""
    sources = (sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "pyproject.toml"]
               + sorted(PACKAGE.rglob("*.py")))
    missing = sorted(f"{src.relative_to(ROOT)}: {path}" for src in sources
                     for path in _cited_paths(src.read_text(encoding="utf-8"))
                     if not (PACKAGE / path).is_file())
    assert not missing, "cited but not in precision_audit/:\n" + "\n".join(missing)
