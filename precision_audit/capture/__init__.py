"""The capture stage: the audit's runs of the model, and the typed records they leave (docs/architecture.md).

The stage is split by pass (docs/memory.md): capture/session.py ties the passes together and owns their shared
state (capture/session_state.py); capture/reference_pass.py, capture/format_pass.py and capture/timing.py are the
passes; capture/model_state.py keeps and restores what they change on the user's model; capture/op_tracker.py
tracks each module's own ops. CUDA autocast's numerics, which emulated mode runs the passes under, are their own
package (precision_audit/emulation/).

Example::

    from precision_audit.capture import CaptureConfig, CaptureSession
    with CaptureSession(model, forward, loss_of, CaptureConfig(formats=(Format.BF16,))) as session:
        session.reference_run()
        session.format_run(Format.BF16)
"""

from __future__ import annotations

from .config import CaptureConfig
from .failures import RunFailure
from .model_state import ModelState
from .op_tracker import OpTracker
from .records import CaptureResult, FormatLayerStats, LayerRecord, RunRecord
from .reference_pass import CONTAINER_NOTE
from .session import CaptureSession

__all__ = ["CONTAINER_NOTE", "CaptureConfig", "CaptureResult", "CaptureSession", "FormatLayerStats", "LayerRecord",
           "ModelState", "OpTracker", "RunFailure", "RunRecord"]
