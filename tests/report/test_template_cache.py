"""The report template's compiled code kept between processes (report/template_cache.py): the page rendered from
the cached code is byte for byte the page compiled afresh; the cache answers only for the same template text, the
same environment options and an intact entry; a folder that cannot be made leaves the report as it was."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import jinja2
import pytest

from precision_audit.record.codec import from_json
from precision_audit.report import html
from precision_audit.report.template_cache import TemplateCache, cache_folder, template_cache

GOLDEN = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists()) / "tests" / "golden"
WHEN = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)


@pytest.fixture
def fresh_env(tmp_path, monkeypatch):
    """report.html's environment made anew (as in a new process), its cache under tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    html._env.cache_clear()
    yield tmp_path / "cache" / "precision-audit" / "templates"
    html._env.cache_clear()


def _page() -> str:
    audit = json.loads((GOLDEN / "tiny_gpt.audit.json").read_text())
    return html.render_html(from_json(audit), None, WHEN)


def _no_compiling(monkeypatch) -> None:
    def refuse(*a, **k):
        raise AssertionError("the template was compiled although its code was cached")
    monkeypatch.setattr(jinja2.Environment, "_parse", refuse)


def test_the_page_from_cached_code_is_the_page_compiled_afresh(fresh_env, monkeypatch):
    assert not fresh_env.exists()
    compiled = _page()
    assert [p.suffix for p in fresh_env.iterdir()] == [".jinja2-code"]
    html._env.cache_clear()  # a later process: same folder, new environment
    with monkeypatch.context() as m:
        _no_compiling(m)
        cached = _page()
    assert cached == compiled
    monkeypatch.delenv("XDG_CACHE_HOME")  # and without any cache at all
    monkeypatch.setattr(html, "template_cache", lambda env: None)
    html._env.cache_clear()
    assert _page() == compiled


def test_a_damaged_entry_is_compiled_afresh(fresh_env):
    compiled = _page()
    (entry,) = fresh_env.iterdir()
    entry.write_bytes(entry.read_bytes()[:100])  # truncated: the magic header and checksum intact, the code not
    html._env.cache_clear()
    assert _page() == compiled
    html._env.cache_clear()
    entry.write_bytes(b"not a jinja2 cache file")
    assert _page() == compiled


def test_an_entry_that_cannot_be_written_leaves_the_page_as_it_was(fresh_env, monkeypatch):
    import jinja2.bccache

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(jinja2.bccache.tempfile, "NamedTemporaryFile", full_disk)
    page = _page()
    assert list(fresh_env.iterdir()) == []
    monkeypatch.undo()
    html._env.cache_clear()
    monkeypatch.setattr(html, "template_cache", lambda env: None)
    assert _page() == page


def test_an_unusable_folder_means_no_cache_and_the_same_page(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("a file where the cache folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    html._env.cache_clear()
    try:
        assert template_cache(html._env()) is None
        assert html._env().bytecode_cache is None
        page = _page()
    finally:
        html._env.cache_clear()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setattr(html, "template_cache", lambda env: None)
    html._env.cache_clear()
    try:
        assert _page() == page
    finally:
        html._env.cache_clear()


def _render(folder: Path, source: str, **options) -> str:
    env = jinja2.Environment(loader=jinja2.DictLoader({"t.j2": source}), **options)
    env.bytecode_cache = TemplateCache(folder, env)
    return env.get_template("t.j2").render(x="<b>")


def test_the_cache_answers_only_for_the_same_text_and_options(tmp_path):
    folder = tmp_path / "c"
    folder.mkdir()
    assert _render(folder, "{{ x }}|{% if true %}\n  yes\n{% endif %}") == "<b>|\n  yes\n"
    assert _render(folder, "{{ x }}!") == "<b>!", "a changed template text reused the old code"
    # the same text under other options: other code (escaping, whitespace control), not the cached one
    assert _render(folder, "{{ x }}!", autoescape=True) == "&lt;b&gt;!"
    text = "{{ x }}|{% if true %}\n  yes\n{% endif %}"
    assert _render(folder, text, trim_blocks=True, lstrip_blocks=True) == "<b>|  yes\n"
    assert _render(folder, text) == "<b>|\n  yes\n"
    assert len(list(folder.iterdir())) == 3  # one entry per (template, options): default, autoescape, trim


def test_the_folder_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_folder() == tmp_path / "precision-audit" / "templates"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_folder() == Path.home() / ".cache" / "precision-audit" / "templates"
