"""The README's "From Python", "In a notebook" and "In a Trainer" examples, and the Lightning one moved to
docs/integrations.md ("In a Trainer"), run as written (in a temporary folder, one namespace, in that order), and
leave the files they say they write. The README's and ``--help``'s lists of export targets are the registry's."""

from __future__ import annotations

import json
import re

from conftest import ROOT

SECTIONS = ("From Python", "In a notebook", "In a Trainer")
#: (file, section) in the order they run: the README's, then the Lightning example of docs/integrations.md
PLACES = [("README.md", s) for s in SECTIONS] + [("docs/integrations.md", "In a Trainer")]


def _has_lightning() -> bool:
    try:
        import lightning  # noqa: F401
    except ImportError:
        return False
    return True


def _blocks(section: str, page: str = "README.md") -> list[str]:
    text = (ROOT / page).read_text(encoding="utf-8")
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
    for page, section in PLACES:
        for i, code in enumerate(_blocks(section, page)):
            if "import lightning" in code and not _has_lightning():
                # the Lightning example needs the lightning extra (tests/integrations/test_integrations.py says so)
                continue
            exec(compile(code, f"{page} ({section}, example {i + 1})", "exec"), namespace)
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



def test_the_lightning_example_is_in_the_integrations_page():
    assert any("import lightning" in b for b in _blocks("In a Trainer", "docs/integrations.md"))


def test_readme_and_help_list_the_registrys_export_targets(capsys):
    """README's usage line, README's integrations table and the command line's --help name exactly the targets
    ``precision-audit export --to`` takes (issue 35: they listed four of six)."""
    from precision_audit.cli import main
    from precision_audit.export import EXPORT_TARGETS

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    usage = re.findall(r"^    precision-audit export POLICY --to (\S+)", readme, flags=re.M)
    assert usage and all(u.split("|") == list(EXPORT_TARGETS) for u in usage), usage
    table = next(ln for ln in readme.splitlines() if ln.startswith("| `precision-audit export POLICY --to T`"))
    assert set(re.findall(r"`(\w+)`", table.split("|")[2])) == set(EXPORT_TARGETS), table
    try:
        main(["--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if "precision-audit export POLICY --to" in ln]
    assert re.search(r"--to (\S+)", line).group(1).split("|") == list(EXPORT_TARGETS), line


def test_sample_readme_states_the_loss_scale_the_tool_recommends():
    """sample_models/README.md said fp16_trouble's loss scale is "around 2^12"; the audit says 2^17 (issue 35)."""
    text = (ROOT / "sample_models" / "README.md").read_text(encoding="utf-8")
    claimed = re.search(r"the audit recommends 2\^(\d+)", text)
    assert claimed, "sample_models/README.md no longer says which scale the audit recommends for fp16_trouble"
    ls = json.loads((ROOT / "tests" / "golden" / "fp16_trouble.audit.json").read_text())["loss_scale"]
    assert 2.0 ** int(claimed.group(1)) == ls["recommended_init_scale"]
    lo, hi = (int(x).bit_length() - 1 for x in ls["safe_range"])
    assert f"safe range of 2^{lo}–2^{hi}" in text
