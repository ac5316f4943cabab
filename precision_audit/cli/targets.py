"""``precision-audit targets``: the table of target GPUs (names, aliases, dense peaks) that ``--target`` takes."""

from __future__ import annotations

import argparse


def targets_main(argv: list[str]) -> int:
    """Print the GPU table (precision_audit/gpus.py); ``argv`` is what follows the word ``targets``."""
    p = argparse.ArgumentParser(prog="precision-audit targets",
                                description="Print the table of target GPUs (names, aliases, dense peaks).")
    p.parse_args(argv)
    from ..gpus import format_targets_table

    print(format_targets_table())
    return 0
