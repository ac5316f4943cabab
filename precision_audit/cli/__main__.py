"""``python -m precision_audit.cli``: the same as ``python -m precision_audit`` (exit codes in README.md)."""

from . import main

main()  # ends the process itself, with the command's exit code
