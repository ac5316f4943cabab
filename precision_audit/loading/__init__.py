"""MODEL, BATCH and loss loading (precision_audit/loading/model.py); a package from here on."""

from .model import *  # noqa: F403
from .model import __all__, _interpret  # noqa: F401
