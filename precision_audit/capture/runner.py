"""The capture runs, as other modules import them: the session and its records (re-exported).

The capture stage is split by pass (docs/memory.md): capture/session.py ties the passes together;
capture/reference_pass.py, capture/format_pass.py and capture/timing.py are the passes; capture/model_state.py
keeps and restores what they change on the user's model; capture/op_tracker.py tracks each module's own ops.
"""

from __future__ import annotations

from .failures import RunFailure
from .model_state import ModelState
from .op_tracker import OpTracker
from .records import CaptureResult, FormatLayerStats, LayerRecord, RunRecord
from .reference_pass import CONTAINER_NOTE
from .session import CaptureConfig, CaptureSession

__all__ = ["CONTAINER_NOTE", "CaptureConfig", "CaptureResult", "CaptureSession", "FormatLayerStats", "LayerRecord",
           "ModelState", "OpTracker", "RunFailure", "RunRecord"]
