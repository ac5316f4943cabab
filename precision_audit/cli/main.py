"""``main()``: run one command and end with its exit code (the codes: precision_audit/cli/__init__.py).

Every command's outcome reaches :func:`run_command`, the one path from an error to an exit code; a Ctrl-C at
any moment reaches :func:`main`'s interrupt path (exit 130). This module imports no torch: the Ctrl-C handling
is in place before torch's import starts.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from ..errors import EXIT_BROKEN_PIPE, EXIT_INTERNAL, EXIT_INTERRUPTED, AuditError, check_torch_version
from .commands import AUDIT, find

__all__ = ["INTERRUPTED_LINE", "main", "run_command"]


INTERRUPTED_LINE = ("precision-audit: interrupted; no half-written file was left in --out (it holds the previous "
                    "results untouched, or the complete new ones)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command and return its exit code (module docstring).

    Called with no arguments, as the console script and ``python -m precision_audit`` do, it ends the process
    itself (:func:`_end_process`), so that a Ctrl-C even during interpreter shutdown still gives exit 130
    rather than a death by signal. Called with ``argv`` (tests, other programs) it returns, and argparse's own
    exits (``--help``, usage errors) raise ``SystemExit`` as usual.
    """
    ctrl_c = _CtrlC()  # first: a SIGINT from here on takes the interrupt path
    as_process = argv is None
    own_exit: SystemExit | None = None
    try:
        try:
            args = list(sys.argv[1:] if argv is None else argv)
            code = run_command(args)
        except SystemExit as e:  # argparse: --help/--version (0) or a usage error (2, message already printed)
            own_exit, code = e, _exit_status(e)
    except KeyboardInterrupt:
        own_exit, code = None, ctrl_c.interrupted()
    if as_process:
        _end_process(code, ctrl_c)
    ctrl_c.restore()
    if own_exit is not None:
        raise own_exit
    return code


def run_command(argv: list[str]) -> int:
    """Run the command ``argv`` asks for (precision_audit/cli/commands.py) and turn every way it can end into
    its exit code, with one message on stderr: the one error path of the command line.

    - an :class:`~precision_audit.errors.AuditError` (any subclass): its message, exit 2;
    - the device running out of memory: a user error too (a smaller batch), exit 2;
    - ``sys.exit()`` called by the user's code (a forward, a loss_fn): the file and line, exit 2;
    - standard output closed by its reader (``| head``): nothing more is printed, exit 141;
    - anything else is a bug: one line (``--verbose`` adds the traceback), exit 3.

    ``SystemExit`` from precision-audit's own argparse parsers (``--help``, a usage error) passes through.
    """
    command, rest = find(argv)
    try:
        if not {"-h", "--help", "--version"} & set(argv):
            check_torch_version()
        return command.load()(rest)
    except AuditError as e:
        return _user_error(e)
    except SystemExit as e:
        if _exit_is_ours(e):
            raise
        # The user's code called sys.exit() (verify's forward, ...).
        from ..loading import model_exit_error

        return _user_error(model_exit_error(e))
    except BrokenPipeError as e:
        if _stdout_reader_gone():
            return _reader_gone()
        return _internal_error(e, argv)
    except Exception as e:
        if _is_out_of_memory(e):
            during = "the audit" if command is AUDIT else f"precision-audit {command.name}"
            return _user_error(AuditError(f"the device ran out of memory during {during}",
                                          found=str(e).splitlines()[0][:200] if str(e) else type(e).__name__,
                                          hint="use a smaller batch, or run with --device cpu"))
        return _internal_error(e, argv)


def _stdout_reader_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it (poll reports an error on its write end), so
    that a BrokenPipeError from elsewhere (a socket in the user's code) is not taken for it."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _reader_gone() -> int:
    """The reader went away: point standard output at /dev/null, so that the interpreter's last flush of what is
    still buffered cannot fail again at exit, and say nothing (as ``cat`` ended by a closed pipe says nothing)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
    return EXIT_BROKEN_PIPE


def _user_error(e: AuditError) -> int:
    print(f"precision-audit: error: {e.message}", file=sys.stderr)
    return e.exit_code


def _internal_error(e: Exception, argv: list[str]) -> int:
    """A bug: one line, the traceback only with --verbose."""
    if _verbose(argv):
        traceback.print_exc(file=sys.stderr)
    text = " ".join(str(e).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    print(f"precision-audit: internal error (exit {EXIT_INTERNAL}): {type(e).__name__}"
          + (f": {text}" if text else "")
          + ("; this is a bug in precision-audit, please report it" if _verbose(argv)
             else "; run again with --verbose to see the traceback, and please report it"),
          file=sys.stderr)
    return EXIT_INTERNAL


def _is_out_of_memory(e: BaseException) -> bool:
    """``torch.OutOfMemoryError``, without importing torch (a command that never imported it had none)."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return isinstance(oom, type) and isinstance(e, oom)


def _verbose(argv: list[str]) -> bool:
    return any(a == "--verbose" or re.fullmatch(r"-[a-zA-Z]*v[a-zA-Z]*", a) for a in argv if a != "--")


def _exit_status(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _exit_is_ours(e: SystemExit) -> bool:
    """True for a ``SystemExit`` raised by precision-audit itself or by the argparse parser it called; False
    when it comes from anything precision-audit called into (the user's model, through torch or not)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # precision_audit/
    frames = traceback.extract_tb(e.__traceback__)
    ours = [i for i, f in enumerate(frames) if os.path.abspath(f.filename).startswith(package)]
    if not ours or ours[-1] == len(frames) - 1:
        return True
    return os.path.basename(frames[ours[-1] + 1].filename) == "argparse.py"


class _CtrlC:
    """The command line's SIGINT handling (main thread only; elsewhere Python's own applies).

    The first SIGINT raises ``KeyboardInterrupt`` and from then on SIGINT is ignored: the interrupt path
    (removing the staging folder, putting the model back, printing the one line) runs to its end whatever the
    user presses. precision_audit/outputs.py holds a SIGINT back while it moves files into place and hands it
    to this handler afterwards.
    """

    def __init__(self) -> None:
        self._old: Any = None
        self._active = threading.current_thread() is threading.main_thread()
        self.late: list[int] = []
        if self._active:
            self._old = signal.signal(signal.SIGINT, self._first)

    @staticmethod
    def _first(signum: int, frame: object) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    def ignore(self) -> None:
        if not self._active:
            return
        while True:  # a SIGINT landing between the except clause and this call raises once more
            try:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                return
            except KeyboardInterrupt:
                continue

    def interrupted(self) -> int:
        self.ignore()
        print(INTERRUPTED_LINE, file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED

    def record_late(self) -> None:
        """From now on a SIGINT is only noted (the process is ending): :func:`_end_process` turns it into 130."""
        if self._active:
            signal.signal(signal.SIGINT, lambda signum, frame: self.late.append(signum))

    def restore(self) -> None:
        if self._active:
            signal.signal(signal.SIGINT, self._old if self._old is not None else signal.default_int_handler)


def _end_process(code: int, ctrl_c: _CtrlC) -> NoReturn:
    """End the process with ``code`` (130 if a Ctrl-C arrived meanwhile), without the interpreter's shutdown,
    where a SIGINT would kill the process by the signal or print a traceback from an atexit callback."""
    ctrl_c.record_late()
    if code != EXIT_INTERRUPTED:
        import atexit

        try:
            atexit._run_exitfuncs()  # logging's flush, tensorboard's writers...
        except BaseException:  # noqa: BLE001 - the command's own result stands
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    if ctrl_c.late and code != EXIT_INTERRUPTED:
        try:
            print(INTERRUPTED_LINE, file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
        code = EXIT_INTERRUPTED
    os._exit(code)
