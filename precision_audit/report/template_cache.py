"""The report template's compiled code, kept between processes (docs/performance.md, "The report's template").

jinja2 turns report.html.j2 into Python code on the first render of each process: parsing, code generation and
Python's ``compile`` took 0.4-1 s, most of the writing stage and more than rendering the page itself. A
:class:`TemplateCache` keeps that code (jinja2's bytecode cache, marshalled) in
``$XDG_CACHE_HOME/precision-audit/templates`` (``~/.cache/precision-audit/templates``), so later audits load it
in about a millisecond. The page is the same either way: the code is what jinja2 would generate again.

A cached entry is used only for the same template text (jinja2 checks a checksum of the source), the same
Python (jinja2's magic header) and the same jinja2 release and environment options (in the entry's key: the
generated code depends on them). Nothing is cached when the folder cannot be made or written, and an
unreadable entry is compiled afresh: the cache can cost a render nothing but the compile it would have done.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

import jinja2
from jinja2.bccache import Bucket

#: The environment's options that the generated code depends on (syntax, whitespace, escaping, optimisation).
_OPTIONS = ("block_start_string", "block_end_string", "variable_start_string", "variable_end_string",
            "comment_start_string", "comment_end_string", "line_statement_prefix", "line_comment_prefix",
            "trim_blocks", "lstrip_blocks", "newline_sequence", "keep_trailing_newline", "autoescape",
            "optimized", "finalize", "is_async", "undefined")


def cache_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "precision-audit" / "templates"


class TemplateCache(jinja2.FileSystemBytecodeCache):
    """jinja2's file-system bytecode cache, keyed also by the jinja2 release and the environment's options, and
    silent when an entry cannot be written (module docstring; jinja2 itself compiles afresh where an entry is
    missing, unreadable, truncated or from another Python)."""

    def __init__(self, folder: Path, env: jinja2.Environment) -> None:
        super().__init__(str(folder), "%s.jinja2-code")
        settings = [jinja2.__version__] + [repr(getattr(env, o, None)) for o in _OPTIONS]
        settings += sorted(repr(e) for e in env.extensions)
        self.settings = hashlib.sha256("\0".join(settings).encode()).hexdigest()[:16]

    def get_cache_key(self, name: str, filename: str | None = None) -> str:
        return super().get_cache_key(f"{name}\0{self.settings}", filename)

    def dump_bytecode(self, bucket: Bucket) -> None:
        with contextlib.suppress(OSError):
            super().dump_bytecode(bucket)


def template_cache(env: jinja2.Environment) -> TemplateCache | None:
    """A cache in :func:`cache_folder` for ``env``'s templates; None when the folder cannot be made."""
    folder = cache_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return TemplateCache(folder, env)
