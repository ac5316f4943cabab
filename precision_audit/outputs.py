"""Atomic writes into the output folder.

Every file is written to a temporary name in the same folder and moved into place with ``os.replace``,
so an interrupted or failed audit never leaves a half-written file where a good one was. The moves
themselves run with SIGINT blocked, so Ctrl-C cannot leave a new audit.json beside an old report.html.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from pathlib import Path

from .errors import OutputError


def check_out_dir(out: Path) -> None:
    """Fail early (before any model runs) when ``out`` cannot hold the results: it is a file, or a probe
    file cannot be created in it (or in its nearest existing parent). ``os.access`` is not enough: it says
    yes to root on a read-only folder."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} is a file, not a folder", expected="a folder (created if missing)",
                          hint="pass another --out, or remove the file")
    parent = out if out.exists() else _existing_parent(out)
    try:
        fd, probe = tempfile.mkstemp(prefix=".precision-audit-probe.", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OutputError(f"--out {out} is not writable", found=f"{type(e).__name__}: {e.strerror or e}",
                          hint="pass a folder you can write to with --out") from e
    for name in ("audit.json", "policy.json", "report.html"):
        if (out / name).is_dir():
            raise OutputError(f"--out {out} holds a folder named {name}, where the audit writes a file",
                              hint=f"remove or rename {out / name}, or pass another --out")


def _existing_parent(p: Path) -> Path:
    p = p.absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        raise OutputError(f"--out {p} is a file, so no folder can be made inside it", hint="pass another --out")
    return p


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class _NoInterrupt:
    """Hold a Ctrl-C back while inside and raise it on exit (main thread only).

    A Python-level handler, not pthread_sigmask: the kernel may hand a process-directed SIGINT to any thread
    that does not block it (torch's worker threads), and Python then still raises in the main thread.
    """

    def __enter__(self) -> None:
        self._pending: list[int] = []
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, lambda signum, frame: self._pending.append(signum))

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            if self._pending and exc[0] is None:
                raise KeyboardInterrupt


def write_files(out: Path, files: dict[str, str | bytes]) -> list[Path]:
    """Write ``{relative name: content}`` into ``out``: every file staged first, then all moved into place."""
    check_out_dir(out)
    written = []
    temps: list[str] = []
    try:
        out.mkdir(parents=True, exist_ok=True)
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
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; results are ordinary files
            staged.append((tmp, target))
        with _NoInterrupt():
            for tmp, target in staged:
                os.replace(tmp, target)
                temps.remove(tmp)
                written.append(target)
    except OSError as e:
        raise OutputError(f"could not write the results into {out}", found=f"{type(e).__name__}: {e}",
                          hint="check the folder's permissions and free space, or pass another --out") from e
    finally:
        for tmp in temps:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return written
