"""All-or-nothing writes into the output folder.

Every output of a command (audit.json, policy.json, report.html, the profiler traces and TensorBoard events
under ``tb/``) is first written completely into a hidden staging folder inside ``--out``. Only then are the
files moved into place, with ``os.replace``; an old file that is replaced is moved aside first, and if any
move fails the ones already made are undone, so the folder holds either the previous results untouched or the
complete new ones (README.md, "Exit codes"). The moves run with Ctrl-C held back: a SIGINT that lands during
them takes effect once they are done.

Example::

    with Staging(out) as stage:
        stage.write("audit.json", text)
        write_scalars(audit, stage.folder("tb/audit"))       # any writer that wants a folder
        stage.replace_old("tb/audit", "events.out.tfevents.*.precision-audit")
        files = stage.commit()                               # the paths now in place, under ``out``
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from .errors import OutputError

STAGING_PREFIX = ".precision-audit-staging."
_RESULT_FILES = ("audit.json", "policy.json", "report.html")


def check_out_dir(out: Path, folders: Iterable[str] = ()) -> None:
    """Fail early (before any model runs) when ``out`` cannot hold the results: it is a file, a probe file
    cannot be created in it (or in its nearest existing parent), a result file's name is taken by a folder, or
    one of ``folders`` (``tb``, ...) is taken by a file. ``os.access`` is not enough: it says yes to root on a
    read-only folder."""
    out = Path(out)
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
    for name in _RESULT_FILES:
        if (out / name).is_dir():
            raise OutputError(f"--out {out} holds a folder named {name}, where the audit writes a file",
                              hint=f"remove or rename {out / name}, or pass another --out")
    for name in folders:
        _check_folder_free(out, name)


def _check_folder_free(out: Path, name: str) -> None:
    p = out
    for part in Path(name).parts:
        p = p / part
        if p.exists() and not p.is_dir():
            raise OutputError(f"--out {out} holds a file named {p.relative_to(out)}, where the audit writes a "
                              "folder (its profiler traces and TensorBoard events)",
                              expected=f"{p.relative_to(out)} to be a folder, or absent",
                              hint=f"remove or rename {p}, or pass another --out")


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
    """Hold a Ctrl-C back while inside, and deliver it on exit to the handler that was installed before
    (main thread only; elsewhere this does nothing).

    A Python-level handler, not pthread_sigmask: the kernel may hand a process-directed SIGINT to any thread
    that does not block it (torch's worker threads), and Python then still runs the handler in the main thread.
    Delivering the held signal to the previous handler (rather than raising ``KeyboardInterrupt`` here) lets
    the command line's handler start its interrupt path, which ignores further Ctrl-Cs (precision_audit/cli/main.py).
    """

    def __enter__(self) -> None:
        self._pending: list[tuple[int, FrameType | None]] = []
        self._old: Callable[[int, FrameType | None], Any] | int | None = None
        self._active = threading.current_thread() is threading.main_thread()
        if self._active:
            self._old = signal.signal(signal.SIGINT, lambda signum, frame: self._pending.append((signum, frame)))

    def __exit__(self, *exc: object) -> None:
        if not self._active:
            return
        signal.signal(signal.SIGINT, self._old if self._old is not None else signal.default_int_handler)
        if self._pending and exc[0] is None:
            signum, frame = self._pending[0]
            if callable(self._old):
                self._old(signum, frame)
            elif self._old != signal.SIG_IGN:
                raise KeyboardInterrupt


class Staging:
    """A hidden folder inside ``out`` where a command's outputs are written in full before any of them replaces
    an old one; :meth:`commit` moves them all into place (or none). Leaving the ``with`` block removes the
    staging folder, and ``out`` itself when this object created it and nothing was committed."""

    def __init__(self, out: Path, folders: Iterable[str] = ()) -> None:
        self.out = Path(out)
        self._folders = tuple(folders)
        self._dir: Path | None = None
        self._created_out = False
        self._committed = False
        self._removals: list[tuple[str, str]] = []

    # -- building -------------------------------------------------------------------------------------------
    def __enter__(self) -> Staging:
        check_out_dir(self.out, self._folders)
        try:
            if not self.out.exists():
                self.out.mkdir(parents=True)
                self._created_out = True
            _remove_dead_stagings(self.out)
            self._dir = Path(tempfile.mkdtemp(prefix=_staging_prefix(), dir=self.out))
        except OSError as e:
            self._cleanup()
            raise _write_error(self.out, e) from e
        return self

    def __exit__(self, *exc: object) -> None:
        self._cleanup()

    def _cleanup(self) -> None:
        with _NoInterrupt():  # a Ctrl-C here must not leave the staging folder (and the old files) behind
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None
            if self._created_out and not self._committed:
                try:
                    self.out.rmdir()  # only when empty: never removes anything but what this object made
                except OSError:
                    pass

    @property
    def root(self) -> Path:
        if self._dir is None:
            raise RuntimeError("Staging is used outside its with block")
        return self._dir

    def write(self, name: str, content: str | bytes) -> None:
        """Stage the file ``name`` (relative to ``out``, ``/``-separated) with ``content``."""
        target = self._staged(name)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as f:
                f.write(content.encode("utf-8") if isinstance(content, str) else content)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise _write_error(self.out, e) from e

    def folder(self, name: str) -> Path:
        """The staged folder for ``name`` (created), for writers that write a folder of their own."""
        p = self._staged(name)
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _write_error(self.out, e) from e
        return p

    def replace_old(self, folder: str, pattern: str) -> None:
        """At commit, also remove the old files matching ``pattern`` in ``out/folder`` (an earlier audit's
        TensorBoard events, which would otherwise show beside the new ones)."""
        self._removals.append((folder, pattern))

    def _staged(self, name: str) -> Path:
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise ValueError(f"not a relative output name: {name!r}")
        return self.root / rel

    # -- committing -----------------------------------------------------------------------------------------
    def commit(self) -> list[Path]:
        """Move every staged file into place under ``out``; returns their paths, in name order.

        Old files are moved aside into the staging folder first, and put back if any move fails, so an
        OSError here leaves ``out`` as it was (and raises :class:`OutputError`).
        """
        root = self.root
        names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()
                       and not p.relative_to(root).as_posix().startswith(".old/"))
        moves: list[tuple[Path, Path | None, Path | None]] = []  # (target, staged or None, aside or None)
        made_dirs: list[Path] = []
        with _NoInterrupt(), _locked(self.out):
            try:
                for name in names:
                    target = self.out / name
                    made_dirs += _make_parents(target.parent, self.out)
                    aside = self._set_aside(target, name)
                    os.replace(root / name, target)
                    moves.append((target, root / name, aside))
                new = set(names)
                for folder, pattern in self._removals:
                    for old in sorted((self.out / folder).glob(pattern)):
                        name = old.relative_to(self.out).as_posix()
                        if name not in new and old.is_file():
                            moves.append((old, None, self._set_aside(old, name)))
            except OSError as e:
                _undo(moves, made_dirs)
                raise _write_error(self.out, e) from e
            except BaseException:
                _undo(moves, made_dirs)
                raise
            self._committed = True
        return [self.out / n for n in names]

    def _set_aside(self, target: Path, name: str) -> Path | None:
        if not (target.exists() or target.is_symlink()):
            return None
        if target.is_dir() and not target.is_symlink():
            raise IsADirectoryError(f"{target} is a folder, where a file goes")
        aside = self.root / ".old" / name
        aside.parent.mkdir(parents=True, exist_ok=True)
        os.replace(target, aside)
        return aside


class _locked:
    """An exclusive ``flock`` on the ``out`` folder itself (no lock file is left behind), so that two commands
    committing into the same folder at once do not interleave their files. Where ``fcntl`` is missing
    (Windows), nothing is locked."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._fd: int | None = None

    def __enter__(self) -> None:
        try:
            import fcntl

            self._fd = os.open(self._folder, os.O_RDONLY)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except (ImportError, OSError):
            if self._fd is not None:
                os.close(self._fd)
            self._fd = None

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the lock


def _staging_prefix() -> str:
    return f"{STAGING_PREFIX}{socket.gethostname()}.{os.getpid()}."


def _remove_dead_stagings(out: Path) -> None:
    """Remove staging folders that a killed run (SIGKILL, power loss) left in ``out``: only those made on this
    host by a process that no longer exists, never a concurrent run's."""
    host = socket.gethostname()
    for d in out.glob(STAGING_PREFIX + "*"):
        host_pid = d.name[len(STAGING_PREFIX):].rsplit(".", 1)[0]
        h, _, pid = host_pid.rpartition(".")
        if h != host or not pid.isdigit() or not d.is_dir():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except OSError:  # alive, owned by someone else
            pass


def _make_parents(folder: Path, out: Path) -> list[Path]:
    made = []
    missing = []
    p = folder
    while p != out and not p.exists():
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        p.mkdir()
        made.append(p)
    return made


def _undo(moves: list[tuple[Path, Path | None, Path | None]], made_dirs: list[Path]) -> None:
    for target, staged, aside in reversed(moves):
        try:
            if staged is not None:
                os.replace(target, staged)
            if aside is not None:
                os.replace(aside, target)
        except OSError:
            pass
    for d in reversed(made_dirs):
        try:
            d.rmdir()
        except OSError:
            pass


def _write_error(out: Path, e: OSError) -> OutputError:
    return OutputError(f"could not write the results into {out}", found=f"{type(e).__name__}: {e}",
                       hint="check the folder's permissions and free space, or pass another --out")


def write_files(out: Path, files: Mapping[str, str | bytes]) -> list[Path]:
    """Write ``{relative name: content}`` into ``out``: every file staged first, then all moved into place."""
    with Staging(out) as stage:
        for name, content in files.items():
            stage.write(name, content)
        written = stage.commit()
    order = {name: i for i, name in enumerate(files)}
    return sorted(written, key=lambda p: order.get(p.relative_to(Path(out)).as_posix(), len(order)))
