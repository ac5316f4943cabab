"""The module calls running now in a capture session, and the ops each has run itself.

The session's hooks push and pop the calls (capture/session.py); the reference forward's op tracker counts each op
under the innermost one (capture/op_tracker.py); the ranks' hook reads which module is running
(capture/ranks.py). Split from session_state.py so that those read it without the session's other state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .ops import ModuleOps
from .records import LayerRecord


@dataclass
class CallStack:
    """The module calls running now, and the ops each has run itself: the session's hooks push and pop the calls
    (capture/session.py), the reference forward's op tracker counts each op under the innermost one
    (capture/op_tracker.py). The session owns it and hands it to the tracker, which sees nothing else of it."""

    names: dict[int, str]  # id(module) -> its named_modules() name
    modules: dict[int, torch.nn.Module]
    layer: Callable[[torch.nn.Module], LayerRecord]  # the module's record, made on its first call
    stack: list[int] = field(default_factory=list)  # id(module) of each call running, innermost last
    own_ops: list[int] = field(default_factory=list)  # per call on the stack: the ops it ran itself
    own_work: list[int] = field(default_factory=list)  # per call on the stack: its own ops other than additions
    rerunning: bool = False  # a module is being re-run alone: its ops are not the model's
    outside_ops: ModuleOps = field(default_factory=ModuleOps)  # the ops outside every module (the loss)
