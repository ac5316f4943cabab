"""The audit across ranks with torch.distributed (issue 15; README.md, "Distributed"; docs/distributed.md).

Two ways in, both torchrun's launcher:

- ``torchrun --nproc-per-node N -m precision_audit MODEL --batch BATCH [--shard ddp|fsdp] ...``;
- ``precision-audit MODEL --batch BATCH --nproc N ...``, which starts the same through torch.distributed.run.

What each rank does is in :mod:`precision_audit.distributed.run`; how the statistics are put back together in
:mod:`precision_audit.distributed.reduce`. Nothing here runs unless one of the two forms is used.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..errors import OptionError

__all__ = ["add_options", "check_options", "launched_by_torchrun"]


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a torchrun (or torch.distributed launcher) job."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def _nproc(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} ranks: give 1 or more")
    return n


def add_options(p: argparse.ArgumentParser) -> None:
    """The audit command's distributed options."""
    p.add_argument("--nproc", type=_nproc, default=None, metavar="N",
                   help="run the audit on N ranks of this machine through torchrun's launcher; the batch is the "
                        "global batch, split along dimension 0 (see README.md, \"Distributed\")")
    p.add_argument("--shard", choices=("ddp", "fsdp"), default=None,
                   help="with --nproc or under torchrun: wrap the model in DDP (default), or fully_shard each block "
                        "of its largest ModuleList and the root (FSDP2); a model file's parallelize(model, mesh) "
                        "replaces both")


def check_options(args: Any) -> None:
    if args.shard is not None and not (args.nproc or launched_by_torchrun()):
        raise OptionError("--shard applies to a distributed audit only",
                          hint="add --nproc N, or run under torchrun --nproc-per-node N -m precision_audit ...")
    if args.nproc and not launched_by_torchrun():
        limit, what = rank_limit(args.device, args.emulate)
        if args.nproc > limit:
            raise OptionError(f"--nproc {args.nproc} starts more ranks than this machine runs at once",
                              expected=f"at most {limit}: {what}", found=f"--nproc {args.nproc}",
                              hint=f"use --nproc {limit} or fewer (the global batch is the same whatever the number "
                                   "of ranks); to oversubscribe on purpose, start the ranks yourself: torchrun "
                                   "--nproc-per-node N -m precision_audit ...")


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def rank_limit(device: str, emulate: bool) -> tuple[int, str]:
    """How many ranks ``--nproc`` may start on this machine, and why: one per CUDA device for CUDA ranks (NCCL
    runs one rank per GPU), one per CPU core this process may use for CPU ranks (more only share the cores: each
    rank is slower, the audit no faster, and the memory grows by a process per rank). CUDA ranks are the ones
    precision_audit/distributed/run.py starts: ``--device cuda``, or ``auto`` with CUDA present and no
    ``--emulate``."""
    if device == "cuda" or (device == "auto" and not emulate):
        import torch

        if torch.cuda.is_available():  # (--device cuda without CUDA is refused by the audit itself)
            n = torch.cuda.device_count()
            return n, f"the {n} CUDA device(s) visible to this process, one per rank"
    n = _cpu_cores()
    return n, f"the {n} CPU core(s) this process may run on, one per rank"


def launch(argv: list[str], nproc: int, verbose: bool, interrupted_line: str) -> int:
    from .launch import launch as _launch

    return _launch(argv, nproc, verbose, interrupted_line)


def run_rank(opts: Any, shard: str | None, progress: Any, verbose: bool) -> Any:
    from .run import run_rank as _run_rank

    return _run_rank(opts, shard, progress, verbose)
