"""Atomic writes into the output folder.

Every file is written to a temporary name in the same folder and moved into place with ``os.replace``,
so an interrupted or failed audit never leaves a half-written file where a good one was.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import OutputError


def check_out_dir(out: Path) -> None:
    """Fail early (before any model runs) when ``out`` cannot hold the results."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} is a file, not a folder", expected="a folder (created if missing)",
                          hint="pass another --out, or remove the file")
    parent = out if out.exists() else _existing_parent(out)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"--out {out} is not writable", found=f"no write permission on {parent}",
                          hint="pass a folder you can write to with --out")


def _existing_parent(p: Path) -> Path:
    p = p.absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        raise OutputError(f"--out {p} is a file, so no folder can be made inside it", hint="pass another --out")
    return p


def write_files(out: Path, files: dict[str, str | bytes]) -> list[Path]:
    """Write ``{relative name: content}`` into ``out`` atomically, file by file. Returns the paths written."""
    check_out_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    temps: list[str] = []
    try:
        staged = []
        for name, content in files.items():
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            temps.append(tmp)
            with os.fdopen(fd, "wb") as f:
                f.write(content.encode("utf-8") if isinstance(content, str) else content)
                f.flush()
                os.fsync(f.fileno())
            staged.append((tmp, target))
        for tmp, target in staged:
            os.replace(tmp, target)
            temps.remove(tmp)
            written.append(target)
    finally:
        for tmp in temps:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return written
