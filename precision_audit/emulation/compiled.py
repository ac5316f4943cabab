"""Compiled emulation kernels: build once, load when built.

The emulation's AutocastCPU kernels are Python functions (emulation.py). Each call costs a round trip from the
dispatcher into Python, about 20-40 us on a small CPU, which dominates the emulated step of a small model. The
same kernels for the three busiest policies (the GEMM family, fp32 and fp32-with-dtype) are written in C++ in
``_emulation_kernels.cpp``; they are bit-identical to the Python ones (tests/emulation/test_compiled_kernels.py).

The same library holds the fused statistics (``range_stats``, ``error_sums``: capture/stats.py), which read each
tensor once.

**The fast path is the default** (docs/performance.md, "Compiled kernels: built automatically"): with
``--kernels auto`` (the default) an audit loads the library when it is built, and otherwise builds it first, once,
with one progress line saying so
(a C++ compiler and ninja are needed; about 20-40 s on 2 cores). When it cannot be built (no compiler, no ninja,
a failed compile) the audit says so in one line and uses the Python kernels and statistics, which give the same
results; a failed compile is remembered (a ``.failed`` note beside the build folder) so that later audits do not
retry it. ``precision-audit build-kernels`` is the explicit pre-build (it also retries a failed one).
``PRECISION_AUDIT_AUTO_BUILD=0`` turns the automatic build off (the test suite does: tests use the Python path
unless they test the compiled one).

The library goes into a cache folder named after the torch and Python versions and the hash of the source and the
build flags, so a torch upgrade never loads a stale library. The cache folder is ``$PRECISION_AUDIT_KERNEL_DIR``
when set, else ``$XDG_CACHE_HOME/precision-audit/kernels`` (``~/.cache/precision-audit/kernels``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..errors import AuditError
from ..options import KERNEL_CHOICES

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_emulation_kernels.cpp")
# -fopenmp: at::parallel_for in the statistics kernels is ATen's OpenMP implementation, a `#pragma omp parallel`
# that a build without it compiles to one thread. (The library then uses the libgomp torch has loaded.)
# -O3: the statistics' per-element loops are written for the vectorizer (blocks of four lanes, no branches);
# -ffp-contract=off: no fused multiply-adds, so that their sums are the same bits on every CPU (an FMA rounds
# once where the Python path's float64 product and sum round twice).
BUILD_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
LIBRARY_NAME = "precision_audit_emu"

_loaded: Path | None = None


def cache_root() -> Path:
    env = os.environ.get("PRECISION_AUDIT_KERNEL_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "precision-audit" / "kernels"


def build_dir() -> Path:
    """Where the library for this torch, Python and source lives."""
    digest = hashlib.sha256(SOURCE.read_bytes() + repr(BUILD_FLAGS).encode()).hexdigest()[:12]
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return cache_root() / f"torch-{torch.__version__}-{py}-{digest}"


def library_path() -> Path:
    return build_dir() / f"{LIBRARY_NAME}.so"


def is_built() -> bool:
    return library_path().is_file()


def is_loaded() -> bool:
    return _loaded is not None


def load() -> bool:
    """Load the built library into this process; False when it is not built."""
    global _loaded
    if _loaded is not None:
        return True
    path = library_path()
    if not path.is_file():
        return False
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        raise AuditError(f"the compiled kernels in {path} cannot be loaded: {str(e).strip()[:300]}",
                         hint=f"delete {path.parent} and run precision-audit build-kernels again, "
                              "or use --kernels python") from None
    _loaded = path
    return True


def failure_note() -> Path:
    """Where a failed compile of this source, torch and Python is remembered (by the automatic build only)."""
    d = build_dir()
    return d.with_name(d.name + ".failed")


def auto_build_enabled() -> bool:
    return os.environ.get("PRECISION_AUDIT_AUTO_BUILD", "1").strip().lower() not in ("0", "no", "false", "off")


def build(verbose: bool = False) -> tuple[Path, float]:
    """Compile the kernels into :func:`build_dir` (atomically: a failed build leaves nothing); returns the
    library's path and the seconds spent. Raises :class:`AuditError` with the reason when it cannot."""
    final = build_dir()
    if (final / f"{LIBRARY_NAME}.so").is_file():
        return final / f"{LIBRARY_NAME}.so", 0.0
    if shutil.which(os.environ.get("CXX", "c++")) is None and shutil.which("g++") is None:
        raise AuditError("cannot build the compiled kernels: no C++ compiler found (looked for $CXX, c++, g++)",
                         hint="install one (e.g. apt install g++), or keep the Python kernels (--kernels python)")
    from torch.utils import cpp_extension

    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        raise AuditError("cannot build the compiled kernels: ninja is not installed",
                         hint="pip install ninja, then run precision-audit build-kernels again") from None
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    t0 = time.perf_counter()
    def compile_with(cflags: list[str], ldflags: list[str]) -> None:
        cpp_extension.load(LIBRARY_NAME, sources=[str(SOURCE)], build_directory=str(work), is_python_module=False,
                           extra_cflags=cflags, extra_ldflags=ldflags, verbose=verbose)

    try:
        try:
            compile_with(list(BUILD_FLAGS), ["-fopenmp"])
        except Exception:  # a compiler without OpenMP (Apple's clang): the same kernels, one thread in the stats
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            compile_with([f for f in BUILD_FLAGS if f != "-fopenmp"], [])
            log.warning("the compiled kernels were built without OpenMP (the compiler has none): their statistics "
                        "run on one thread")
    except Exception as e:  # the compiler's own message is the useful part
        shutil.rmtree(work, ignore_errors=True)
        raise AuditError(f"building the compiled kernels failed: {str(e).strip()[-2000:]}",
                         hint="the Python kernels still work (--kernels python)") from None
    seconds = time.perf_counter() - t0
    global _loaded
    failure_note().unlink(missing_ok=True)
    try:
        work.rename(final)
    except OSError:  # another process finished the same build first: keep its copy
        shutil.rmtree(work, ignore_errors=True)
    # load() above has already loaded the library (from the work folder) into this process.
    _loaded = final / f"{LIBRARY_NAME}.so"
    return _loaded, seconds


def _auto_build() -> bool:
    """Build the library now (``--kernels auto`` found none): one progress line, or one line saying why not."""
    note = failure_note()
    if note.is_file():
        log.warning("compiled kernels: an earlier automatic build failed (%s); using the Python kernels "
                    "(precision-audit build-kernels retries)", note.read_text(errors="replace").strip()[:200])
        return False
    log.warning("building the compiled kernels once for torch %s (about 20-40 s; cached in %s)",
                torch.__version__, cache_root())
    try:
        build()
    except AuditError as e:
        problem = e.problem.splitlines()[0][:300]
        if "failed" in e.problem:  # a compile error: remembered, so later audits do not pay for it again
            try:
                note.parent.mkdir(parents=True, exist_ok=True)
                note.write_text(e.problem[-2000:] + "\n")
            except OSError:
                pass
        log.warning("%s; using the Python kernels (same results, slower on small models)", problem)
        return False
    return True


def resolve(choice: str) -> str:
    """``auto`` -> ``compiled`` when built (and loads it), else builds them (unless
    ``PRECISION_AUDIT_AUTO_BUILD=0``) and falls back to ``python`` when that cannot be done.
    ``compiled`` requires them built."""
    if choice not in KERNEL_CHOICES:
        raise AuditError(f"--kernels must be one of {', '.join(KERNEL_CHOICES)}, not {choice!r}")
    if choice == "python":
        return "python"
    try:
        if load():
            return "compiled"
    except AuditError as e:
        if choice == "compiled":
            raise
        log.warning("%s; using the Python kernels", e.problem)
        return "python"
    if choice == "compiled":
        raise AuditError(f"--kernels compiled: the compiled kernels are not built for torch {torch.__version__} "
                         f"(looked in {build_dir()})",
                         hint="run precision-audit build-kernels once, or use --kernels auto")
    if auto_build_enabled() and _auto_build():
        return "compiled"
    return "python"


def ops():
    return torch.ops.precision_audit_emu
