"""One rank of a distributed audit (``torchrun -m precision_audit ...`` or ``precision-audit ... --nproc N``).

Every rank loads the model file and the global batch, keeps its share of the batch (precision_audit/distributed/
batch.py), applies the parallelism (shard.py) and runs the ordinary audit (audit.py's ``compute_audit``) with a
capture session that reduces each pass's statistics across ranks (session.py). Every rank then holds the same
global statistics and takes the same decisions; rank 0 alone writes the outputs, all or nothing as in one process.

The process group serves every collective the audit makes: gloo for CPU ranks; for CUDA ranks NCCL for CUDA tensors
(the loss, DDP and FSDP) and gloo for the CPU tensors of the audit's own checks and reductions
(:func:`backend_for`). A rank that sees one GPU (``--gpus-per-task``, one device in CUDA_VISIBLE_DEVICES) uses it
(:func:`cuda_index`).

Failures (docs/distributed.md, "Failures"; failure.py): loading and splitting are agreed on before any rank
computes, and so is the structure of every rank's batch; a failure later (an exception of the model on one rank,
a rank that exits, is killed or hangs) ends every rank within seconds through the store, with one message naming
the rank and its own error and the exit code one process would give (2 for a user error).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import signal
import sys
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from .. import record as R
from ..errors import EXIT_INTERNAL, EXIT_INTERRUPTED, AuditError, ModelLoadError, OptionError
from ..options import AuditOptions
from . import failure
from .failure import Board, Watchdog

log = logging.getLogger(__name__)


def backend_for(device: str) -> str:
    """The process group's backend for ranks on ``device``: NCCL serves CUDA tensors only, and the audit's own
    checks and reductions run on CPU tensors (lockstep.py, reduce.py), so CUDA ranks pair NCCL with gloo."""
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def cuda_index(local_rank: int, local_world: int, count: int) -> int:
    """The CUDA device of the rank ``local_rank`` of ``local_world`` on this machine, which sees ``count``: its
    own GPU ``local_rank`` when the launcher shows every rank all of them; the one it sees when it shows each rank
    one (SLURM ``--gpus-per-task=1``, CUDA_VISIBLE_DEVICES set per rank)."""
    if count < 1:
        raise OptionError("a CUDA rank sees no CUDA device", expected="at least one visible GPU per rank",
                          found=f"torch.cuda.device_count() == 0 on local rank {local_rank}",
                          hint="check CUDA_VISIBLE_DEVICES, or audit on the CPU (--device cpu)")
    if count == 1:
        return 0
    if local_rank < count:
        return local_rank
    raise OptionError(f"local rank {local_rank} of {local_world} has no GPU of its own",
                      expected=f"a GPU per rank on this machine (local ranks 0..{local_world - 1})",
                      found=f"{count} visible GPUs",
                      hint="start at most one rank per GPU (--nproc or --nproc-per-node), or give each rank one "
                           "GPU (CUDA_VISIBLE_DEVICES per rank, SLURM --gpus-per-task=1)")


def run_rank(opts: AuditOptions, shard: str | None, progress: Any, verbose: bool = False) -> Any:
    """Run this rank's part of the audit. Returns the saved result on rank 0, the exit code on the others (which
    print nothing); a failure ends the process with its exit code (module docstring)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    watchdog = Watchdog(rank, world)  # signals, the launcher's end: from here on
    watchdog.start()
    signal.signal(signal.SIGTERM, _terminated)  # the launcher stops the ranks with SIGTERM: unwind cleanly
    try:
        device = _device(opts)
    except AuditError as e:  # no process group yet: this rank says it (every rank sees the same devices)
        failure.say(failure.rank_message(e.message, rank, world, e.exit_code))
        failure.report_to_launcher(rank, e.exit_code)
        failure.end(e.exit_code)
    if device == "cpu":
        _return_freed_memory()
    timeout = datetime.timedelta(seconds=watchdog.timeout_s + failure.BACKSTOP_S)
    dist.init_process_group(backend_for(device), timeout=timeout)
    board = Board(dist.distributed_c10d._get_default_store(), rank, world)
    watchdog.attach(board)
    try:
        loaded = _load_agreed(opts, rank, world, device, board)
        return _audit(opts, shard, progress, rank, world, device, *loaded, board=board, watchdog=watchdog)
    except KeyboardInterrupt:
        failure.end(EXIT_INTERRUPTED)  # the launcher says it, once
    except SystemExit as e:  # the model file's code (parallelize, init_weights) called sys.exit()
        from ..loading import model_exit_error

        err = model_exit_error(e, opts.model)
        board.fail(err.message, err.exit_code)
    except AuditError as e:
        board.fail(e.message, e.exit_code)
    except Exception as e:
        _unexpected(e, board, verbose)
    return None


def _unexpected(e: Exception, board: Board, verbose: bool) -> None:
    """An exception no stage turned into a user error: a peer's failure seen from this rank, the device out of
    memory, or a bug of precision-audit."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # a peer failed first and a collective of this rank broke: its message
        failed = board.failure()
        if failed is not None:
            failure.end(int(failed["code"]))
        time.sleep(0.05)
    if failure.raised_by_collective(e):
        failure.collective_broke(board, e)
    oom = getattr(torch, "OutOfMemoryError", None)
    if isinstance(oom, type) and isinstance(e, oom):
        board.fail("the device ran out of memory during the audit: "
                   f"{str(e).splitlines()[0][:200] if str(e) else type(e).__name__}\n"
                   "  fix: use a smaller batch, or run with --device cpu", 2)
    if verbose:
        import traceback

        traceback.print_exc(file=sys.stderr)
    text = " ".join(str(e).split())[:300]
    board.fail(f"{type(e).__name__}: {text}" + ("" if verbose else "; run again with --verbose to see the traceback"),
               EXIT_INTERNAL, internal=True)


def _load_agreed(opts: AuditOptions, rank: int, world: int, device: str, board: Board) -> tuple[Any, Any, Any]:
    """Load and split, then agree: nobody starts computing unless every rank could load its share, and every
    rank's batch has the same structure (the same tensors, dtypes and dimensions; their sizes may differ)."""
    from ..outputs import check_out_dir

    problem: tuple[int, str, int] | None = None
    loaded: tuple[Any, Any, Any] | None = None
    try:
        if rank == 0:
            check_out_dir(opts.out, ("tb", "tb/audit"))
        loaded = _load(opts, rank, world)
    except AuditError as e:
        problem = (rank, e.message, e.exit_code)
    except SystemExit as e:  # sample_batch(rank, world_size) or the factory called sys.exit()
        from ..loading import model_exit_error

        err = model_exit_error(e, opts.model)
        problem = (rank, err.message, err.exit_code)
    share = loaded[2] if loaded is not None else None
    facts = (problem, _structure(share) if share is not None else None, _gpu(device),
             share.local_size if share is not None else 0)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, facts)
    failed = [f[0] for f in every if f[0] is not None]
    if failed:
        r, message, code = failed[0]
        board.fail(message, code, about=r)
    _same_structure([f[1] for f in every])
    _own_gpus([f[2] for f in every])
    assert loaded is not None and share is not None
    if share.global_size is None:  # sample_batch(rank, world_size): weights from every rank's sample count
        share = dataclasses.replace(share, weight=share.local_size / sum(f[3] for f in every))
    return loaded[0], loaded[1], share


def _structure(share: Any) -> list[str]:
    """What must be alike on every rank in its batch: each tensor's name, dtype and number of dimensions."""
    return [f"{d['name']} {d['dtype']} {len(d['shape'])}-D" for d in share.batch.describe()]


def _same_structure(structures: list[list[str]]) -> None:
    q = next((q for q, s in enumerate(structures) if s != structures[0]), None)
    if q is None:
        return
    from ..errors import BatchError

    raise BatchError("the ranks' batches differ in structure, so they cannot be audited as one global batch",
                     expected="on every rank the same tensors, with the same dtypes and dimensions",
                     found=f"rank 0: {', '.join(structures[0]) or 'no tensor'}; rank {q}: "
                           f"{', '.join(structures[q]) or 'no tensor'}",
                     hint="make sample_batch(rank, world_size) return the same structure on every rank (a target "
                          "on every rank, or on none)")


def _gpu(device: str) -> tuple[str, str] | None:
    if not device.startswith("cuda"):
        return None
    import socket

    return socket.gethostname(), str(getattr(torch.cuda.get_device_properties(device), "uuid", device))


def _own_gpus(gpus: list[tuple[str, str] | None]) -> None:
    """NCCL cannot run two ranks on one GPU: refuse it by name rather than let NCCL fail at its first call."""
    seen: dict[tuple[str, str], int] = {}
    for q, g in enumerate(gpus):
        if g is None:
            continue
        if g in seen:
            raise OptionError(f"ranks {seen[g]} and {q} use the same GPU", expected="one GPU per rank",
                              found=f"{g[1]} on {g[0]}",
                              hint="show each rank its own GPU (CUDA_VISIBLE_DEVICES per rank), or start fewer ranks")
        seen[g] = q


#: glibc's mallopt parameter, and the size from which a CPU rank's allocations get their own mapping
_M_MMAP_THRESHOLD, _OWN_MAPPING_BYTES = -3, 1 << 20


def _return_freed_memory() -> bool:
    """On glibc, allocations of 1 MiB and more get their own memory mapping, returned to the system when freed.

    glibc's default raises its mapping threshold to the size of each large block freed (up to 32 MiB), after
    which FSDP2's gathered parameters, gradients and weight copies of up to that size come from the heap and stay
    resident after they are freed: measured on a rank of the 2-rank audit of a 128 MiB model, its peak resident
    memory went from 437 to 841 MiB (docs/distributed.md, "Memory per rank"). A threshold the user set
    (MALLOC_MMAP_THRESHOLD_) is left as it is. Returns whether the setting was made."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or not sys.platform.startswith("linux"):
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _OWN_MAPPING_BYTES))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): its own allocator's behaviour
        return False


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _device(opts: AuditOptions) -> str:
    if opts.device == "cuda" or (opts.device == "auto" and not opts.emulate and torch.cuda.is_available()):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        index = cuda_index(local, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count())
        torch.cuda.set_device(index)
        return f"cuda:{index}"
    return "cpu"


def on_meta(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def _load(opts: AuditOptions, rank: int, world: int) -> tuple[Any, Any, Any]:
    from ..loading import check_trainable, load_model
    from .batch import rank_share

    model, source = load_model(opts.model)
    if on_meta(model):  # built on the meta device: materialised shard by shard after sharding (_materialise)
        if not callable(vars(source.module).get("init_weights")):
            raise ModelLoadError(
                f"the model built by {source.attribute} in {source.where} is on the meta device (no values) and "
                "the file defines no init_weights(model)",
                expected="def init_weights(model): ... that fills the parameters and buffers in place once the "
                         "audit has sharded the model and given each rank its shard",
                hint="define init_weights(model) in the model file (e.g. calling reset_parameters() on each "
                     "module), or build the model on a real device")
    else:
        check_trainable(model, source)
    share = rank_share(opts.batch, model, source, rank, world)
    return model, source, share


def _materialise(model: torch.nn.Module, source: Any, device: str) -> None:
    """Storage for this rank's part of a meta-device model (its FSDP shards, or the whole model under DDP), then
    the file's ``init_weights(model)``: no rank ever holds more than its part of the parameters."""
    from ..errors import ModelRunError
    from ..loading import check_trainable

    model.to_empty(device=device)
    try:
        with torch.no_grad():
            vars(source.module)["init_weights"](model)
    except Exception as e:
        raise ModelRunError(f"init_weights(model) in {source.where} raised {type(e).__name__}: {e}",
                            hint="init_weights receives the sharded model: fill parameters in place "
                                 "(nn.init.* functions and reset_parameters() work on FSDP2's DTensors)") from e
    check_trainable(model, source)


def _rss() -> tuple[int, int]:
    """(resident bytes now, peak resident bytes so far) of this process (Linux /proc; zeros elsewhere)."""
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0, 0


def _shard(model: torch.nn.Module, source: Any, shard: str | None, device: str, unused: list[str]) -> Any:
    """The parallelism applied (shard.py); what the file's ``parallelize(model, mesh)`` raises, or a model it
    leaves on the meta device, is the user's error."""
    from ..loading.failures import exception_text, raise_site
    from . import shard as sharding

    user = "parallelize" in vars(source.module)
    before = on_meta(model)
    try:
        sharded = sharding.apply(model, source, shard, device, unused)
    except Exception as e:
        if not user or isinstance(e, AuditError) or failure.raised_by_collective(e):
            raise
        raise ModelLoadError(f"parallelize(model, mesh) in {source.where} raised {exception_text(e)}",
                             found=raise_site(e, getattr(source.module, "__file__", None)),
                             hint="parallelize receives the model and a 1-D DeviceMesh over the ranks; it shards or "
                                  "wraps the model in place (fully_shard, parallelize_module) or returns a wrapper "
                                  "(DDP)") from e
    if user and not before and on_meta(model):
        where = next((n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), "?")
        raise ModelLoadError(f"parallelize(model, mesh) in {source.where} left the model on the meta device: its "
                             "values are gone", expected="a model that keeps its values (sharded or wrapped in place)",
                             found=f"'{where}' on the meta device after parallelize()",
                             hint="do not move the model to 'meta' in parallelize(); to build a model no rank holds "
                                  "whole, build it on the meta device in the factory and define init_weights(model)")
    return sharded


def _audit(opts: AuditOptions, shard: str | None, progress: Any, rank: int, world: int, device: str, model: Any,
           source: Any, share: Any, *, board: Board, watchdog: Watchdog) -> Any:
    from ..audit import Subject, compute_audit, result_of
    from . import unused as unused_check
    from .lockstep import Lockstep
    from .session import DistributedCaptureSession, Untracked
    from .tensors import set_replicated_owner

    meta = on_meta(model)
    sharded_first = shard == "fsdp" or "parallelize" in vars(source.module)
    if meta and not sharded_first:  # DDP replicates: each rank holds the whole model anyway
        _materialise(model, source, device)
    elif device.startswith("cuda") and not meta:
        model.to(device)
    unused: list[str] = []
    if shard in (None, "ddp") and "parallelize" not in vars(source.module):
        # DDP cannot reduce what no loss reaches: found first, on every rank (unused.py)
        raised = partial(failure.model_raised, board, part=unused_check.PART, where=None,
                         model_file=getattr(source.module, "__file__", None))
        unused = unused_check.agreed_unused(model, source, share.batch, device, raised)
    sharded = _shard(model, source, shard, device, unused)
    start_rss, _ = _rss()  # torch.distributed's modules imported, nothing materialised yet (meta)
    if meta and sharded_first:
        _materialise(model, source, device)
    _, loaded_peak = _rss()
    untracked = Untracked()
    untracked.install(sharded.model)
    set_replicated_owner(rank)

    def refuse(e: AuditError) -> None:  # the ranks diverged: every rank ends, one says why (lockstep.py)
        board.fail(e.message, e.exit_code)

    lockstep = Lockstep(refuse=refuse, done=board.count_collective)
    model_raised = partial(failure.model_raised, board, model_file=getattr(source.module, "__file__", None))
    factory = partial(DistributedCaptureSession, run_module=sharded.run_module, weight=share.weight,
                      untracked=untracked, original_types=sharded.original_types, lockstep=lockstep,
                      model_raised=model_raised)
    try:
        c = compute_audit(opts, progress if rank == 0 else None,
                          subject=Subject(sharded.model, source, share.batch), session_factory=factory)
    finally:
        set_replicated_owner(None)
        untracked.remove()
    root_class = sharded.original_types.get("", type(model).__name__)  # fully_shard renames it FSDP<class>
    c.record.model.class_ = root_class
    c.policy = dataclasses.replace(c.policy, model_class=root_class)
    c.record.distributed = R.Distributed(
        world_size=world,
        backend=dist.get_backend(),
        parallelism=sharded.how,
        batch=(share.how.replace(f" on rank {rank}", " on each rank") if share.global_size else
               "sample_batch(rank, world_size) in the model file: each rank's share"),
        global_batch_size=share.global_size,
        rank0_batch_size=share.local_size,
        reduced="per-layer statistics summed over ranks (counts, histograms, error sums), maxima maxed, the loss "
                "weighted by each rank's share of the batch; shapes, op counts, memory and time estimates are "
                "one rank's (its share of the batch)",
    )
    c.record.distributed.memory = _memory(sharded.model, rank, world, meta, start_rss, loaded_peak)
    highest, _ = lockstep.check("the end of the audit", [c.exit_code])  # every rank done, nothing written yet
    if rank != 0:
        dist.barrier()
        _close(watchdog)
        return int(highest[0])
    try:
        with watchdog.disarmed():  # a peer's end or a signal must not cut the commit short (outputs.py keeps it whole)
            result = result_of(c)
            result.save(opts.out)
    finally:
        dist.barrier()  # the others wait for the outputs (and end if rank 0 failed writing them)
        _close(watchdog)
    return result


def _memory(model: torch.nn.Module, rank: int, world: int, meta: bool, start_rss: int,
            loaded_peak: int) -> R.DistributedMemory:
    """audit.json's ``distributed.memory``: every rank's parameter bytes and resident memory (a collective)."""
    from .tensors import local_tensor

    _, peak = _rss()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # global shapes
    held = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
    memory: list[Any] = [None] * world
    dist.all_gather_object(memory, R.RankMemory(rank=rank, parameter_bytes_held=held, rss_start_bytes=start_rss,
                                                rss_peak_after_init_bytes=loaded_peak, rss_peak_bytes=peak))
    return R.DistributedMemory(
        model_parameter_bytes=param_bytes,
        materialised="shard by shard from the meta device, then init_weights(model)" if meta else "as built",
        ranks=memory,
        note="resident memory of each rank's process (torch itself included): once the model was wrapped or "
             "sharded (before a meta-device model is materialised), its peak once the model was initialised, "
             "and its peak over the whole audit",
    )


def _close(watchdog: Watchdog) -> None:
    watchdog.stop()  # the audit is over: what a peer does now no longer ends this rank
    dist.destroy_process_group()
