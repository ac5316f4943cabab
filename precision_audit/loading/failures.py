"""How a failure of the user's code is told: the exception, the line in the user's file that raised it, and
the ``sys.exit()`` a model must never call.

Every loader (:mod:`.model`, :mod:`.batch`, :mod:`.loss`) runs user code (the import, the factory,
``sample_batch()``, ``loss_fn``) and turns what it raises into one :class:`~precision_audit.errors.AuditError`
whose ``found`` names the user's line, never precision-audit's (README.md, "Exit codes").

Example::

    try:
        fn()
    except Exception as e:
        raise BatchError(f"sample_batch() raised {exception_text(e)}", found=raise_site(e, "model.py")) from e
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

from precision_audit.errors import ModelLoadError, ModelRunError

__all__ = ["EXIT_HINT", "exception_text", "import_failure", "model_exit_error", "raise_site", "syntax_failure",
           "type_name"]

EXIT_HINT = ("a model must return or raise, never end the process: remove the sys.exit() call, or move script "
             "code (argument parsing, training) under `if __name__ == '__main__':`")

# Frames in this package are the loader's own, never the user's line (see raise_site).
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def syntax_failure(e: SyntaxError, *, where: str) -> ModelLoadError:
    filename = Path(e.filename).name if e.filename else where
    line = (e.text or "").strip()
    return ModelLoadError(
        f"syntax error in {filename}, line {e.lineno}: {e.msg}",
        expected="a Python file that imports without errors",
        found=f"{filename}, line {e.lineno}: {line}" if line else f"{filename}, line {e.lineno}",
        hint=f"run `python {e.filename}` to see the error in context" if e.filename else None,
    )


def import_failure(e: BaseException, *, where: str, user_file: str | None) -> ModelLoadError:
    if isinstance(e, SystemExit):
        return ModelLoadError(
            f"importing {where} raised {exception_text(e)}: the file called sys.exit({e.code!r})",
            expected="a model file that imports without ending the process",
            found=raise_site(e, user_file) or f"SystemExit while importing {where}",
            hint=EXIT_HINT,
        )
    return ModelLoadError(
        f"importing {where} raised {exception_text(e)}",
        expected="a model file that imports without errors",
        found=raise_site(e, user_file) or f"{type(e).__name__} while importing {where}",
        hint="fix the error in the model file; it must be importable without command-line arguments",
    )


def model_exit_error(e: SystemExit, model: str | None = None) -> ModelRunError:
    """The error for a ``sys.exit(n)`` that the user's code (forward, loss_fn, sample_batch...) called while
    the audit ran it: exit 2 with the file and line, instead of ending precision-audit with code ``n`` and no
    message (README.md, "Exit codes")."""
    frames = traceback.extract_tb(e.__traceback__)
    site = None
    if frames:
        f = frames[-1]
        site = f"{Path(f.filename).name}, line {f.lineno}" + (f": {f.line.strip()}" if f.line else "")
    return ModelRunError(
        f"the model called sys.exit({e.code!r}) while precision-audit ran it, so the audit stopped",
        expected=f"the code of MODEL {model} to return or raise" if model else "the model's code to return or raise",
        found=site or f"SystemExit({e.code!r}) from the model's code",
        hint=EXIT_HINT,
    )


def exception_text(e: BaseException) -> str:
    message = str(e)
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


def raise_site(e: BaseException, user_file: str | None) -> str | None:
    """``model.py, line 12: x = nn.Linear(3, -1)``: the deepest traceback frame in the user's file.

    With no ``user_file`` (a package module), the deepest frame outside importlib and this package is used.
    """
    frames: list[traceback.FrameSummary] = list(traceback.extract_tb(e.__traceback__))
    if user_file is not None:
        wanted = os.path.normcase(os.path.realpath(user_file))
        frames = [f for f in frames if os.path.normcase(os.path.realpath(f.filename)) == wanted]
    else:
        frames = [
            f
            for f in frames
            if not f.filename.startswith("<")
            and "importlib" not in f.filename
            and os.path.dirname(os.path.abspath(f.filename)) != _PACKAGE_DIR
        ]
    if not frames:
        return None
    frame = frames[-1]
    text = f"{Path(frame.filename).name}, line {frame.lineno}"
    return f"{text}: {frame.line.strip()}" if frame.line else text


def type_name(obj: Any) -> str:
    cls = type(obj)
    if cls.__module__ == "builtins":
        return f"a {cls.__qualname__}"
    return f"a {cls.__module__}.{cls.__qualname__}"
