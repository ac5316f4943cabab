"""One rank of a distributed audit (``torchrun -m precision_audit ...`` or ``precision-audit ... --nproc N``).

Every rank loads the model file and the global batch, keeps its share of the batch (precision_audit/distributed/
batch.py), applies the parallelism (shard.py) and runs the ordinary audit (audit.py's ``compute_audit``) with a
capture session that reduces each pass's statistics across ranks (session.py). Every rank then holds the same
global statistics and takes the same decisions; rank 0 alone writes the outputs, all or nothing as in one process.

Failures (docs/distributed.md, "Failures"): an error while loading or splitting is agreed on before any rank
starts computing, and rank 0 prints the first failing rank's message. An error later on one rank (an exception
in its forward) ends that process at once with its message, naming the rank; its peers' collectives then fail,
they end without a message of their own, and the launcher stops whatever is left. The exit code is the
failing rank's (2 for a user error).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import signal
import sys
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ..errors import EXIT_INTERNAL, EXIT_INTERRUPTED, AuditError

log = logging.getLogger(__name__)

_FAILED_KEY = "precision_audit/failed"
#: How long a collective may wait for a peer: a peer that died is noticed at once (its connections close);
#: this only bounds a peer that hangs.
TIMEOUT = datetime.timedelta(minutes=10)


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _first_failure() -> bool:
    """True for the first rank to fail (counted in the launcher's store, which outlives the ranks)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        return int(store.add(_FAILED_KEY, 1)) == 1
    except Exception:  # no store (the group is gone): say it rather than stay silent
        return True


def _others_failed() -> bool:
    try:
        store = dist.distributed_c10d._get_default_store()
        return int(store.add(_FAILED_KEY, 0)) > 0
    except Exception:
        return False


def _end(code: int) -> None:
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def run_rank(opts: Any, shard: str | None, progress: Any, verbose: bool = False) -> Any:
    """Run this rank's part of the audit. Returns the saved result on rank 0, the exit code on the others (which
    print nothing); a failure ends the process with its exit code (module docstring)."""
    from ..outputs import check_out_dir

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = _device(opts)
    if device == "cpu":
        _return_freed_memory()
    signal.signal(signal.SIGTERM, _terminated)  # the launcher stops the ranks with SIGTERM: unwind cleanly
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", timeout=TIMEOUT)
    try:
        # 1. load and split, then agree: nobody starts computing unless every rank could load its share
        problem: tuple[int, str, int] | None = None
        try:
            if rank == 0:
                check_out_dir(opts.out, ("tb", "tb/audit"))
            loaded = _load(opts, rank, world)
        except AuditError as e:
            problem = (rank, e.message, e.exit_code)
        problems: list[Any] = [None] * world
        dist.all_gather_object(problems, problem)
        failed = [p for p in problems if p is not None]
        if failed:
            r, message, code = failed[0]
            if rank == 0:
                _say(f"precision-audit: error (rank {r} of {world}): {message}")
            dist.destroy_process_group()
            _end(code)
        return _audit(opts, shard, progress, rank, world, device, *loaded)
    except KeyboardInterrupt:
        _end(EXIT_INTERRUPTED)  # the launcher says it, once
    except AuditError as e:
        if _first_failure():
            _say(f"precision-audit: error (rank {rank} of {world}): {e.message}")
        _end(e.exit_code)
    except Exception as e:
        if _others_failed():  # a collective broke because another rank ended: its message is the one
            log.info("rank %d: stopping, another rank failed (%s)", rank, e)
            _end(2)
        if _first_failure():
            if verbose:
                import traceback

                traceback.print_exc(file=sys.stderr)
            text = " ".join(str(e).split())[:300]
            _say(f"precision-audit: internal error (rank {rank} of {world}, exit {EXIT_INTERNAL}): "
                 f"{type(e).__name__}: {text}" + ("" if verbose else "; run again with --verbose to see the traceback"))
        _end(EXIT_INTERNAL)
    return None


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


def _device(opts: Any) -> str:
    if opts.device == "cuda" or (opts.device == "auto" and not opts.emulate and torch.cuda.is_available()):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return f"cuda:{local}"
    return "cpu"


def on_meta(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def _load(opts: Any, rank: int, world: int) -> tuple[Any, Any, Any]:
    from ..errors import ModelLoadError
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


def _audit(opts: Any, shard: str | None, progress: Any, rank: int, world: int, device: str, model: Any,
           source: Any, share: Any) -> Any:
    from ..audit import Subject, compute_audit, result_of
    from . import shard as sharding
    from .session import DistributedCaptureSession, Untracked
    from .tensors import set_replicated_owner

    weight = share.weight
    if share.global_size is None:  # sample_batch(rank, world_size): weights from every rank's sample count
        sizes = torch.tensor([share.local_size], dtype=torch.int64)
        dist.all_reduce(sizes)
        weight = share.local_size / int(sizes)
    meta = on_meta(model)
    sharded_first = shard == "fsdp" or "parallelize" in vars(source.module)
    if meta and not sharded_first:  # DDP replicates: each rank holds the whole model anyway
        _materialise(model, source, device)
    elif device.startswith("cuda") and not meta:
        model.to(device)
    sharded = sharding.apply(model, source, shard, device)
    start_rss, _ = _rss()  # torch.distributed's modules imported, nothing materialised yet (meta)
    if meta and sharded_first:
        _materialise(model, source, device)
    _, loaded_peak = _rss()
    untracked = Untracked()
    untracked.install(sharded.model)
    set_replicated_owner(rank)
    factory = partial(DistributedCaptureSession, run_module=sharded.run_module, weight=weight, untracked=untracked,
                      original_types=sharded.original_types)
    try:
        c = compute_audit(opts, progress if rank == 0 else None,
                          subject=Subject(sharded.model, source, share.batch), session_factory=factory)
    finally:
        set_replicated_owner(None)
        untracked.remove()
    root_class = sharded.original_types.get("", type(model).__name__)  # fully_shard renames it FSDP<class>
    c.record.model.class_ = root_class
    c.policy = dataclasses.replace(c.policy, model_class=root_class)
    c.record.distributed = {
        "world_size": world,
        "backend": dist.get_backend(),
        "parallelism": sharded.how,
        "batch": (share.how.replace(f" on rank {rank}", " on each rank") if share.global_size else
                  "sample_batch(rank, world_size) in the model file: each rank's share"),
        "global_batch_size": share.global_size,
        "rank0_batch_size": share.local_size,
        "reduced": "per-layer statistics summed over ranks (counts, histograms, error sums), maxima maxed, the loss "
                   "weighted by each rank's share of the batch; shapes, op counts, memory and time estimates are "
                   "one rank's (its share of the batch)",
    }
    _, peak = _rss()
    param_bytes = sum(p.numel() * p.element_size() for p in sharded.model.parameters())  # global shapes
    from .tensors import local_tensor

    held = sum(local_tensor(p).numel() * p.element_size() for p in sharded.model.parameters())
    memory = [None] * world
    dist.all_gather_object(memory, {"rank": rank, "parameter_bytes_held": held,
                                    "rss_start_bytes": start_rss, "rss_peak_after_init_bytes": loaded_peak,
                                    "rss_peak_bytes": peak})
    c.record.distributed["memory"] = {
        "model_parameter_bytes": param_bytes,
        "materialised": "shard by shard from the meta device, then init_weights(model)" if meta else "as built",
        "ranks": memory,
        "note": "resident memory of each rank's process (torch itself included): once the model was wrapped or "
                "sharded (before a meta-device model is materialised), its peak once the model was initialised, "
                "and its peak over the whole audit",
    }
    code = torch.tensor([c.exit_code], dtype=torch.int64)
    dist.broadcast(code, 0)
    if rank != 0:
        dist.barrier()
        dist.destroy_process_group()
        return int(code)
    try:
        result = result_of(c)
        result.save(opts.out)
    finally:
        dist.barrier()  # the others wait for the outputs (and end if rank 0 failed writing them)
        dist.destroy_process_group()
    return result
