"""Command line (precision_audit/cli/main.py); a package from here on."""

from .main import *  # noqa: F403
from .main import EPILOG, MAX_STEPS, _audit_parser, _budget, main  # noqa: F401
