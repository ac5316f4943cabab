"""``precision-audit build-kernels [--verbose]``: compile the emulation's C++ autocast kernels once
(precision_audit/emulation/compiled.py); later emulated audits use them (``--kernels auto``)."""

from __future__ import annotations

import argparse
import sys


def build_kernels_main(argv: list[str]) -> int:
    """Run ``precision-audit build-kernels`` (``argv``: the arguments after the word); returns the exit code."""
    p = argparse.ArgumentParser(
        prog="precision-audit build-kernels",
        description="Compile the emulation's autocast kernels in C++ against the installed torch (a C++ compiler "
                    "and ninja are needed). They give bit-identical results to the Python kernels with less "
                    "overhead per op; emulated audits use them once built (--kernels auto). The library is cached "
                    "per torch and Python version in $PRECISION_AUDIT_KERNEL_DIR, else "
                    "~/.cache/precision-audit/kernels.")
    p.add_argument("--verbose", "-v", action="store_true", help="show the compiler's output")
    args = p.parse_args(argv)
    import torch

    from ..emulation import compiled

    if compiled.is_built():
        print(f"compiled kernels already built: {compiled.library_path()}")
        return 0
    print(f"building the compiled kernels for torch {torch.__version__} (about 15 s on 2 cores)...",
          file=sys.stderr, flush=True)
    path, seconds = compiled.build(verbose=args.verbose)
    print(f"built {path} in {seconds:.1f} s")
    return 0
