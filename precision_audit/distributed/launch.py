"""``precision-audit MODEL --nproc N ...``: start N ranks with torchrun's own launcher (torch.distributed.run).

The command line is run again in each rank as ``python -m precision_audit MODEL ...`` without ``--nproc``, under
a standalone rendezvous on this machine (``torchrun --standalone --nproc-per-node N``). The launcher's exit code
is the failing rank's (2 for a user error, whose message that rank printed, naming itself, and reported in the
launcher's folder: precision_audit/distributed/failure.py), else the ranks' common one. A rank that ended
without a message (killed, ``os._exit()``) is named here, from its exit status. Ctrl-C stops every rank and exits
130 (docs/distributed.md).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from typing import Any

from ..errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_UNSAFE, EXIT_USAGE
from .failure import LAUNCH_DIR_ENV, LAUNCHER_PID_ENV, REPORT_FILE


def strip_nproc(argv: list[str]) -> list[str]:
    """``argv`` without ``--nproc N`` / ``--nproc=N`` (the ranks must not launch again)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        out.append(a)
    return out


def launch(argv: list[str], nproc: int, verbose: bool = False, interrupted_line: str = "") -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if not verbose:  # the launcher's own warnings and failure tables: the failing rank has said what happened
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        logging.getLogger("torch.distributed.run").setLevel(logging.CRITICAL)
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun would set it, without its warning
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    args = get_args_parser().parse_args(
        ["--standalone", "--nproc-per-node", str(nproc), "--monitor-interval", "0.2", "--module", "precision_audit",
         *strip_nproc(argv)])
    old = signal.getsignal(signal.SIGINT)
    folder = tempfile.mkdtemp(prefix="precision-audit-ranks-")  # where the failing rank reports (failure.py)
    saved = {k: os.environ.get(k) for k in (LAUNCH_DIR_ENV, LAUNCHER_PID_ENV)}
    os.environ[LAUNCH_DIR_ENV], os.environ[LAUNCHER_PID_ENV] = folder, str(os.getpid())
    try:
        run(args)
    except ChildFailedError as e:
        return _failed(e.failures, _report(folder), nproc, interrupted_line)
    except (SignalException, KeyboardInterrupt) as e:
        if isinstance(e, SignalException) and e.sigval not in (signal.SIGINT, signal.SIGTERM):
            return EXIT_INTERNAL
        return _interrupted(interrupted_line)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(folder, ignore_errors=True)
        try:
            signal.signal(signal.SIGINT, old)
        except (TypeError, ValueError):
            pass
    return 0


def _report(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, REPORT_FILE)) as f:
            return dict(json.load(f))
    except (OSError, ValueError):
        return None


#: How a rank ends when it did not fail itself: the launcher's SIGTERM, Ctrl-C, or its own interrupt path
_STOPPED = (EXIT_INTERRUPTED, -signal.SIGTERM, -signal.SIGINT)


def _failed(failures: dict[int, Any], report: dict | None, world: int, interrupted_line: str) -> int:
    """The launcher's exit code once some ranks ended with a non-zero status: the reported failure's (its rank
    printed the message); the audit's verdict 1 when every rank ended with it; else the first rank that ended on
    its own without a message, named here from its exit status."""
    if report is not None:
        return int(report.get("code", EXIT_INTERNAL))
    codes = {rank: f.exitcode for rank, f in failures.items()}
    if codes and all(c == EXIT_UNSAFE for c in codes.values()):
        return EXIT_UNSAFE
    causes = [r for r, c in codes.items() if c not in _STOPPED and c != EXIT_UNSAFE]
    if not causes:
        return _interrupted(interrupted_line) if codes else EXIT_INTERNAL
    rank = min(causes, key=lambda r: (failures[r].timestamp, r))
    print(f"precision-audit: error (rank {rank} of {world}): {_ended(codes[rank])}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def _ended(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = (" (the kernel's out-of-memory killer sends SIGKILL: check the memory a rank needs)"
               if -code == signal.SIGKILL else "")
        return f"the rank was killed by {name} before the audit ended, without a message{why}"
    return (f"the rank ended with exit code {code} without a message: os._exit() in the model's code, or a crash "
            "of the process")


def _interrupted(line: str) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if line:
        print(line, file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED
