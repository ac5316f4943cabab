"""Where the FP32 reference's kept tensors live: off the device's memory (docs/memory.md, "Reference memory").

The format passes compare each module's output with the reference pass's FP32 output of the same call, and the
reference backward multiplies dL/dy by each format's local-error difference y_p - y (kept in bf16). Kept in the
device's memory, those are one more copy of every activation (and half of one per format) on top of what a
training step holds — the reason an audit could not fit a model that trains in most of the memory.

- **On a CUDA device** they are copied to pinned host memory as they are made (``non_blocking``: the copy is
  queued on the current stream, so the device tensor can be freed at once and nothing waits), and each one is
  copied back to the device only for the one statistic that reads it, then dropped.
- **On a CPU** host memory is the device's memory, so they are written to a temporary file instead (in
  ``TMPDIR``; unlinked as soon as it is made, so nothing is left behind even if the process is killed) and read
  back, one tensor at a time, for the one statistic that reads it. The space of a tensor nobody holds any more
  is given back to the file system at once (a hole punched in the file). Where that directory is in memory
  itself (tmpfs, ramfs), cannot take a file, or has less than :data:`RESERVE_BYTES` free, the tensors stay in
  memory (from then on), as they did before; ``note`` says why when it happens during an audit.

The figures are the same either way: the copies are exact and every statistic is computed on the device, from
the same values (tests/capture/test_reference_offload.py, tests/capture/test_reference_spill.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import tempfile
import weakref
from typing import Any

import torch

log = logging.getLogger(__name__)

RESERVE_BYTES = 1 << 30  # never fill the spill directory's file system beyond its last GiB
_MEMORY_FILE_SYSTEMS = {"tmpfs", "ramfs", "hugetlbfs"}
_PUNCH_HOLE = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE (linux/falloc.h)


class Spilled:
    """A tensor written to the store's file: its shape and dtype, and where its bytes are.

    It stands for the tensor where the session only looks at it (``shape``; the statistics cache's key, which
    reads ``_version`` and ``data_ptr()``); its values come back through :meth:`ReferenceStore.on`.
    """

    __slots__ = ("shape", "dtype", "device", "offset", "nbytes", "__weakref__")
    _version = 0  # written once, never changed

    def __init__(self, shape: torch.Size, dtype: torch.dtype, device: torch.device, offset: int,
                 nbytes: int) -> None:
        self.shape, self.dtype, self.device, self.offset, self.nbytes = shape, dtype, device, offset, nbytes

    def data_ptr(self) -> int:
        return -1 - self.offset  # unique per kept tensor: the file is only appended to


Kept = torch.Tensor | Spilled


class ReferenceStore:
    """Keeps reference tensors for later comparison: on the host for a CUDA device, in a file for a CPU one."""

    def __init__(self, device: str | torch.device, spill: bool = True, directory: str | None = None) -> None:
        self.offload = torch.device(device).type == "cuda"
        self._pinned = True  # cleared when no pinned-memory allocator exists (a CPU-only build of torch)
        self._device = torch.device(device)
        self.pinned_used = False  # whether a kept tensor went to pinned memory (its cache is emptied at close)
        self._file = _SpillFile.open(directory) if spill and not self.offload else None
        self.spilling = self._file is not None  # new tensors go to the file (the file stays for those in it)
        self.note: str | None = None  # why tensors stayed in memory after all, when they did

    def keep(self, t: torch.Tensor) -> Kept:
        """A copy of ``t`` (detached) to compare against later: on the host when offloading, in the file when
        spilling, else a clone."""
        t = t.detach()
        if self.offload:
            return self.stash(t)
        return self._spill(t) or t.clone()

    def stash(self, t: torch.Tensor) -> Kept:
        """``t`` kept for later: a host copy when offloading, in the file when spilling, else ``t`` itself (the
        caller made it)."""
        if not self.offload:
            return self._spill(t) or t
        if self._pinned:
            try:
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            except RuntimeError:  # no pinned allocator: a pageable copy (synchronous, same values)
                self._pinned = False
            else:
                self.pinned_used = True
                return host.copy_(t, non_blocking=True)
        return t.to("cpu", copy=True)

    def on(self, r: Kept, like: torch.Tensor) -> torch.Tensor:
        """``r``'s values on ``like``'s device, for one statistic (a copy when it was offloaded or spilled; ``r``
        itself otherwise)."""
        if isinstance(r, Spilled):
            assert self._file is not None, "a spilled tensor outlived its store"
            return self._file.read(r).to(like.device)
        if r.device == like.device:
            return r
        return r.to(like.device, non_blocking=True)

    def for_stats(self, r: Kept, like: torch.Tensor) -> torch.Tensor:
        """``r`` as the reference operand of a statistic against ``like`` (:meth:`ErrorStats.update
        <precision_audit.capture.stats.ErrorStats.update>`, :func:`~precision_audit.capture.stats.dot64`): a tensor
        offloaded to the host as it is, since those copy it to ``like``'s device a block at a time (no full-size copy
        of it on the GPU); otherwise as :meth:`on`. The host copy was queued on the device's stream, so the blocks'
        copies back are ordered after it."""
        if isinstance(r, torch.Tensor) and self.offload and r.device.type == "cpu" and like.device.type != "cpu":
            return r
        return self.on(r, like)

    def close(self) -> None:
        """Gives the file's space back (it was unlinked when made), and the pinned host memory the offloaded
        tensors took once nothing holds them (:func:`release_pinned_cache`); tensors still held are unaffected."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self.spilling = False
        if self.pinned_used:
            self.pinned_used = False
            release_pinned_cache(self._device)

    def _spill(self, t: torch.Tensor) -> Spilled | None:
        if not self.spilling or self._file is None:
            return None
        try:
            return self._file.write(t.detach())
        except OSError as e:
            why = ("has less than 1 GiB free" if e.errno == errno.ENOSPC
                   else f"could not be written ({e.strerror or e})")
            self.note = (f"the FP32 references were kept in memory from {self._file.written / 1e6:.0f} MB on: "
                         f"the temporary directory {self._file.directory} {why}; the audit's peak memory is "
                         f"higher by up to one copy of the activations (set TMPDIR to a directory with room)")
            log.warning("%s", self.note)
            self.spilling = False  # the tensors already in the file are still read from it
            return None


class _SpillFile:
    """An unlinked temporary file the kept tensors are appended to, with holes punched where they are freed."""

    def __init__(self, fd: int, directory: str) -> None:
        self.fd: int | None = fd
        self.directory = directory
        self.end = 0  # the next tensor's offset: the file is only appended to
        self.written = 0  # bytes written in all
        self._fallocate = _FALLOCATE

    @classmethod
    def open(cls, directory: str | None) -> _SpillFile | None:
        if not all(hasattr(os, f) for f in ("pwrite", "preadv", "fstatvfs")):  # not on Windows (macOS < 11)
            return None
        directory = directory or tempfile.gettempdir()
        fs = _file_system_type(directory)
        if fs in _MEMORY_FILE_SYSTEMS:
            log.debug("references stay in memory: %s is a %s (memory itself)", directory, fs)
            return None
        try:
            fd, path = tempfile.mkstemp(prefix="precision-audit-references-", dir=directory)
        except OSError as e:
            log.debug("references stay in memory: no file in %s (%s)", directory, e)
            return None
        os.unlink(path)  # nothing is left behind, however the process ends
        return cls(fd, directory)

    def write(self, t: torch.Tensor) -> Spilled:
        assert self.fd is not None
        t = t.contiguous()
        n = t.numel() * t.element_size()
        st = os.fstatvfs(self.fd)
        if st.f_bavail * st.f_frsize < n + RESERVE_BYTES:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        offset, done = self.end, 0
        if n:
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
            while done < n:
                done += os.pwrite(self.fd, view[done:], offset + done)
        self.end += n
        self.written += n
        s = Spilled(t.shape, t.dtype, t.device, offset, n)
        if n and self._fallocate is not None:
            weakref.finalize(s, self._punch, offset, n)
        return s

    def read(self, s: Spilled) -> torch.Tensor:
        assert self.fd is not None
        out = torch.empty(s.shape, dtype=s.dtype)
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if s.nbytes else None  # type: ignore[arg-type]
        done = 0
        while view is not None and done < s.nbytes:
            got = os.preadv(self.fd, [view[done:]], s.offset + done)
            if got == 0:
                raise OSError(errno.EIO, f"the references' file ended early ({done} of {s.nbytes} bytes)")
            done += got
        return out

    def _punch(self, offset: int, n: int) -> None:
        if self.fd is not None and self._fallocate is not None:
            self._fallocate(self.fd, _PUNCH_HOLE, offset, n)  # best effort

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


def _libc_function(name: str, argtypes: list) -> Any:
    """A C library function (the process's own symbols: libc on Linux), or None where there is none."""
    try:
        fn = getattr(ctypes.CDLL(None), name, None)
    except (OSError, TypeError):  # no C library to load this way (Windows)
        return None
    if fn is not None:
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


def _file_system_type(directory: str) -> str | None:
    """The type of the file system ``directory`` is on (Linux: the longest mount point above it), else None."""
    try:
        path = os.path.realpath(directory)
        best, kind = "", None
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, kind = mount, parts[2]
        return kind
    except OSError:
        return None


def release_pinned_cache(device: torch.device) -> None:
    """Gives the pinned host blocks no tensor holds back to the system.

    PyTorch's pinned-memory allocator rounds every block up to a power of two and keeps a freed block cached
    for the life of the process: without this, the host copies of the audit's references would stay pinned
    (unpageable) in a training process after ``precision_audit.audit()`` returns (docs/memory.md, "Reference
    memory"). The device is synchronised first, so that no queued copy still holds a block. Every free cached
    block goes, the program's own too (a pinned ``DataLoader`` allocates its next blocks anew).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is None:  # older torch
        empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def release_free_heap() -> None:
    """Gives the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere).

    Called between passes on a CPU: each pass frees its activations, and glibc keeps the freed pages, scattered
    between the blocks still in use, so the next pass's allocations would grow the process instead of reusing
    them (docs/memory.md, "Reference memory").
    """
    if _TRIM is not None:
        _TRIM(0)


_TRIM = _libc_function("malloc_trim", [ctypes.c_size_t])
_FALLOCATE = _libc_function("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong])
