"""Compiled emulation kernels: build once, load when built.

The emulation's AutocastCPU kernels are Python functions (emulation.py). Each call costs a round trip from the
dispatcher into Python, about 20-40 us on a small CPU, which dominates the emulated step of a small model. The
same kernels for the three busiest policies (the GEMM family, fp32 and fp32-with-dtype) are written in C++ in
``_emulation_kernels.cpp``; they are bit-identical to the Python ones (tests/capture/test_compiled_kernels.py).

They are built on request, never silently: ``precision-audit build-kernels`` compiles them with the installed
torch's headers (a C++ compiler and ninja are needed, about 15 s on 2 cores) into a cache folder named after the
torch and Python versions and the source's hash, so a torch upgrade never loads a stale library. An audit then
uses them when they are built (``--kernels auto``, the default), and says which kernels it used.

The cache folder is ``$PRECISION_AUDIT_KERNEL_DIR`` when set, else ``$XDG_CACHE_HOME/precision-audit/kernels``
(``~/.cache/precision-audit/kernels``).
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

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_emulation_kernels.cpp")
LIBRARY_NAME = "precision_audit_emu"
KERNEL_CHOICES = ("auto", "python", "compiled")

_loaded: Path | None = None


def cache_root() -> Path:
    env = os.environ.get("PRECISION_AUDIT_KERNEL_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "precision-audit" / "kernels"


def build_dir() -> Path:
    """Where the library for this torch, Python and source lives."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
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
    try:
        cpp_extension.load(LIBRARY_NAME, sources=[str(SOURCE)], build_directory=str(work), is_python_module=False,
                           extra_cflags=["-O2"], verbose=verbose)
    except Exception as e:  # the compiler's own message is the useful part
        shutil.rmtree(work, ignore_errors=True)
        raise AuditError(f"building the compiled kernels failed: {str(e).strip()[-2000:]}",
                         hint="the Python kernels still work (--kernels python)") from None
    seconds = time.perf_counter() - t0
    global _loaded
    try:
        work.rename(final)
    except OSError:  # another process finished the same build first: keep its copy
        shutil.rmtree(work, ignore_errors=True)
    # load() above has already loaded the library (from the work folder) into this process.
    _loaded = final / f"{LIBRARY_NAME}.so"
    return _loaded, seconds


def resolve(choice: str) -> str:
    """``auto`` -> ``compiled`` when built (and loads it), else ``python``. ``compiled`` requires them."""
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
    return "python"


def ops():
    return torch.ops.precision_audit_emu
