"""``python -m precision_audit``: the same as the ``precision-audit`` command (exit codes in README.md)."""

from .cli import main

main()  # ends the process itself, with the command's exit code
