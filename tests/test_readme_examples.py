"""The README's "From Python", "In a notebook" and "In a Trainer" examples run as written (in a temporary folder,
one namespace, in README order), and leave the files they say they write."""

from __future__ import annotations

import json
import re

from conftest import ROOT

SECTIONS = ("From Python", "In a notebook", "In a Trainer")


def _has_lightning() -> bool:
    try:
        import lightning  # noqa: F401
    except ImportError:
        return False
    return True


def _blocks(section: str) -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    body = text[start:end if end != -1 else len(text)]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def test_every_section_has_an_example():
    for section in SECTIONS:
        assert _blocks(section), f"README section {section!r} has no ```python example"


def test_readme_examples_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    ran = []
    for section in SECTIONS:
        for i, code in enumerate(_blocks(section)):
            if "import lightning" in code and not _has_lightning():
                # the Lightning example needs the lightning extra (tests/integrations/test_integrations.py says so)
                continue
            exec(compile(code, f"README.md ({section}, example {i + 1})", "exec"), namespace)
            ran.append((section, i))
    assert {s for s, _ in ran} == set(SECTIONS)
    out = capsys.readouterr().out
    assert "precision-audit: Sequential" in out  # print(result.summary())
    audit = json.loads((tmp_path / "audit" / "audit.json").read_text())
    assert audit["model"]["class"] == "Sequential" and audit["loss"]["kind"] == "cross_entropy"
    assert "<details>" in namespace["result"]._repr_html_()
    assert (tmp_path / "run" / "precision-audit" / "policy.json").is_file()
    assert namespace["trainer"] is not None
    if _has_lightning():
        assert (tmp_path / "lightning-run" / "precision-audit" / "audit.json").is_file()

