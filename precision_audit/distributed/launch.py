"""``precision-audit MODEL --nproc N ...``: start N ranks with torchrun's own launcher (torch.distributed.run).

The command line is run again in each rank as ``python -m precision_audit MODEL ...`` without ``--nproc``, under
a standalone rendezvous on this machine (``torchrun --standalone --nproc-per-node N``). The launcher's exit code
is the first failing rank's (2 for a user error, whose message that rank printed, naming itself), else the
ranks' common one; Ctrl-C stops every rank and exits 130 (docs/distributed.md).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from ..errors import EXIT_INTERNAL, EXIT_INTERRUPTED


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
    try:
        run(args)
    except ChildFailedError as e:
        _, first = e.get_first_failure()
        code = first.exitcode
        if code == -signal.SIGINT or code == EXIT_INTERRUPTED:
            return _interrupted(interrupted_line)
        return code if code > 0 else EXIT_INTERNAL
    except (SignalException, KeyboardInterrupt) as e:
        if isinstance(e, SignalException) and e.sigval not in (signal.SIGINT, signal.SIGTERM):
            return EXIT_INTERNAL
        return _interrupted(interrupted_line)
    finally:
        try:
            signal.signal(signal.SIGINT, old)
        except (TypeError, ValueError):
            pass
    return 0


def _interrupted(line: str) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if line:
        print(line, file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED
