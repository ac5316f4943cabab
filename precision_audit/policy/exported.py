"""The result of an export (policy/exporters.py, and fp8/export.py for the FP8 targets): one file's text.

A module of its own so that the FP8 exporters, which the policy's exporters call, need not import them back
(docs/architecture.md: no import cycle)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Export:
    """One exported file: its text, its kind (".json" or ".py") and what the target cannot express."""

    target: str
    text: str
    suffix: str
    notes: tuple[str, ...]
