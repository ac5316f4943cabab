"""The C allocator's settings for the audit's own process (glibc only; elsewhere nothing changes).

PyTorch's CPU tensors come from ``malloc``. glibc serves a large block (above its *mapping threshold*) from a
fresh memory mapping and unmaps it when freed, so the next block of that size faults in and zeroes every page
again; smaller blocks come from the heap, whose free top is given back (trimmed) above a second threshold. The
two processes that run an audit want opposite things:

- **One process** (``precision-audit MODEL``): the passes allocate and free the same sizes over and over (a
  rounded copy of each weight per emulated GEMM, the activations of each re-run). :func:`reuse_freed_memory`
  raises the mapping threshold to glibc's maximum (32 MiB) and stops the trimming, so freed blocks are reused
  from the heap instead of being faulted in again: docs/performance.md, "The allocator".
- **A distributed rank on a CPU**: FSDP2's gathered parameters and gradients must leave the rank's memory when
  freed, or each rank keeps its peak: :func:`return_freed_memory` (docs/distributed.md, "Memory per rank").

Both are process-wide and cannot be undone (glibc has no getter for the old values), so only the command line
calls them, never the Python API in a user's process; a setting the user made through glibc's environment
variables (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``) is left as it is.
"""

from __future__ import annotations

import os
import sys

#: glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: glibc's largest mapping threshold on a 64-bit system (DEFAULT_MMAP_THRESHOLD_MAX: 4 * 1024 * 1024 * sizeof(long))
MAX_MMAP_THRESHOLD = 32 << 20
#: a trim threshold nothing reaches: mallopt takes a C int, so its largest value (2 GiB - 1 of free heap top)
NO_TRIM = (1 << 31) - 1
#: the size from which a CPU rank's allocations get their own mapping
OWN_MAPPING_BYTES = 1 << 20
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def _mallopt(*settings: tuple[int, int]) -> bool:
    """Apply glibc mallopt settings unless the user set any through the environment; whether all were made."""
    if any(v in os.environ for v in _USER_SETTINGS) or not sys.platform.startswith("linux"):
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]  # int mallopt(int param, int value)
        return all(bool(libc.mallopt(param, value)) for param, value in settings)
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): its own allocator's behaviour
        return False


def reuse_freed_memory() -> bool:
    """Blocks up to 32 MiB from the heap, and the heap never trimmed: a freed block is reused, not faulted in
    again. Returns whether the setting was made."""
    return _mallopt((M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD), (M_TRIM_THRESHOLD, NO_TRIM))


def return_freed_memory() -> bool:
    """On glibc, allocations of 1 MiB and more get their own memory mapping, returned to the system when freed.

    glibc's default raises its mapping threshold to the size of each large block freed (up to 32 MiB), after
    which FSDP2's gathered parameters, gradients and weight copies of up to that size come from the heap and stay
    resident after they are freed: measured on a rank of the 2-rank audit of a 128 MiB model, its peak resident
    memory went from 437 to 841 MiB (docs/distributed.md, "Memory per rank"). Returns whether the setting was
    made."""
    return _mallopt((M_MMAP_THRESHOLD, OWN_MAPPING_BYTES))
