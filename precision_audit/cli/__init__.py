"""Command line: ``precision-audit MODEL --batch BATCH [options]`` and its other commands (``targets``,
``verify``, ``report``, ``export``, ``build-kernels``).

Exit codes (README.md, "Exit codes"):

- 0: done (the audit found a safe format, or the command succeeded);
- 1: done, but the model is unsafe as is in every audited low-precision format;
- 2: a user error: bad input, a bad option, or a model that failed or called ``sys.exit()`` (one message
  saying what was expected, what was found and the fix; no traceback);
- 3: an internal error, a bug in precision-audit (one line; ``--verbose`` adds the traceback);
- 130: interrupted (Ctrl-C / SIGINT at any moment): one line, and ``--out`` holds either the previous
  results untouched or the complete new ones;
- 141: standard output closed by its reader (``| head``): the rest of the printed output dropped, nothing else.

The package:

- :mod:`.main` -- ``main()``: Ctrl-C handling, and :func:`~.main.run_command`, the one path from an error to
  an exit code;
- :mod:`.commands` -- the one registry of commands (the first word of the command line -> the function that
  runs it, imported only then);
- one module per command: :mod:`.audit` (no command word), :mod:`.targets`, :mod:`.verify`, :mod:`.report`,
  :mod:`.export`, :mod:`.build_kernels`. A command parses its arguments, calls the library, prints its
  result and raises :class:`~precision_audit.errors.AuditError` for user errors.

Nothing here imports torch at the top: the Ctrl-C handling is in place before torch's import starts.

Example::

    >>> from precision_audit.cli import main
    >>> main(["targets"])                      # doctest: +SKIP
    0
"""

from __future__ import annotations

# _audit_parser and _budget are not public; the tests of the audit's options import them from here.
from .audit import EPILOG, MAX_STEPS
from .audit import _audit_parser as _audit_parser
from .audit import _budget as _budget
from .main import INTERRUPTED_LINE, main, run_command

__all__ = ["EPILOG", "INTERRUPTED_LINE", "MAX_STEPS", "main", "run_command"]
