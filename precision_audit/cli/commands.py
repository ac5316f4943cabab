"""The commands of ``precision-audit``: one registry, looked up by the first word of the command line.

A command is registered once here, with the function that runs it named as ``module:function``. The module
is imported only when its command runs, so that starting the command line imports no torch (the Ctrl-C
handling in precision_audit/cli/main.py is in place first) and ``precision-audit targets`` stays quick. The
``--help`` text lists the commands from this registry (precision_audit/cli/audit.py), and every command's
failures reach the one error path in precision_audit/cli/main.py.

Example::

    >>> command, rest = find(["report", "audit/audit.json"])
    >>> command.name, rest
    ('report', ['audit/audit.json'])
    >>> find(["model.py", "--batch", "x.pt"])[0] is AUDIT     # no command word: the audit itself
    True
"""

from __future__ import annotations

import importlib
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["AUDIT", "Command", "commands", "find", "help_text", "register"]


@dataclass(frozen=True)
class Command:
    """One command: its word, the function that runs it, and its line in ``--help``.

    ``run`` is ``"package.module:function"``; the function takes the arguments after the command's word and
    returns the exit code. User errors it raises as :class:`~precision_audit.errors.AuditError`; it prints
    no error message of its own (precision_audit/cli/main.py does).
    """

    name: str  # the word after ``precision-audit``; "" for the audit itself (``precision-audit MODEL ...``)
    run: str
    usage: str
    summary: str

    def __post_init__(self) -> None:
        module, sep, function = self.run.partition(":")
        if not (sep and module and function.isidentifier()):
            raise ValueError(f"Command.run must be 'package.module:function', got {self.run!r}")
        if self.name and (self.name.startswith("-") or not self.name.replace("-", "").isalnum()):
            raise ValueError(f"Command.name must be a word such as 'build-kernels', got {self.name!r}")

    def load(self) -> Callable[[list[str]], int]:
        """Import the command's module and return its function."""
        module, _, function = self.run.partition(":")
        fn: Callable[[list[str]], int] = getattr(importlib.import_module(module), function)
        return fn


_REGISTRY: dict[str, Command] = {}


def register(command: Command) -> Command:
    """Add ``command``; a second command with the same word is an error (the first one would be shadowed)."""
    if command.name in _REGISTRY:
        raise ValueError(f"the command {command.name or '(audit)'!r} is registered twice: "
                         f"{_REGISTRY[command.name].run} and {command.run}")
    _REGISTRY[command.name] = command
    return command


def commands() -> tuple[Command, ...]:
    """The commands with a word of their own, in the order ``--help`` lists them."""
    return tuple(c for c in _REGISTRY.values() if c.name)


def find(argv: Sequence[str]) -> tuple[Command, list[str]]:
    """The command the arguments ask for, and the arguments it gets (without its word).

    A first argument that is no command's word is the audit's MODEL (a path such as ``verify.py`` is a model,
    not the ``verify`` command).
    """
    if argv and argv[0] and argv[0] in _REGISTRY:
        return _REGISTRY[argv[0]], list(argv[1:])
    return AUDIT, list(argv)


def help_text(indent: int = 2, column: int = 33, width: int = 112) -> str:
    """The "Other commands" block of ``precision-audit --help``: each command's usage and summary."""
    lines: list[str] = []
    for c in commands():
        usage = " " * indent + c.usage
        body = textwrap.wrap(c.summary, width - column)
        if len(usage) < column - 1 and body:
            lines.append(usage.ljust(column) + body.pop(0))
        else:
            lines.append(usage)
        lines += [" " * column + line for line in body]
    return "\n".join(lines)


AUDIT = register(Command(
    "", "precision_audit.cli.audit:audit_main",
    usage="precision-audit MODEL --batch BATCH [options]",
    summary="measure where FP16/BF16 loses accuracy, per layer; write report.html, policy.json and audit.json"))
register(Command(
    "targets", "precision_audit.cli.targets:targets_main",
    usage="precision-audit targets",
    summary="the GPU table (--target names and aliases)"))
register(Command(
    "verify", "precision_audit.cli.verify:verify_main",
    usage="precision-audit verify MODEL --batch BATCH --policy POLICY [--steps N] [--out DIR]",
    summary="A/B short training: FP32 vs the policy vs plain BF16 / FP16"))
register(Command(
    "report", "precision_audit.cli.report:report_main",
    usage="precision-audit report AUDIT_JSON [--out DIR]",
    summary="re-render report.html from a saved audit.json (no model run)"))
register(Command(
    "diff", "precision_audit.cli.diff:diff_main",
    usage="precision-audit diff A B [--json]",
    summary="the layers whose plan, error (beyond the noise floor) or headroom changed between two audit.json files"))
register(Command(
    "export", "precision_audit.cli.export:export_main",
    usage="precision-audit export POLICY --to deepspeed|lightning|accelerate|fsdp|torchao|torchtitan [--out FILE]",
    summary="the policy as another stack's precision settings"))
register(Command(
    "build-kernels", "precision_audit.cli.build_kernels:build_kernels_main",
    usage="precision-audit build-kernels [--verbose]",
    summary="compile the emulation's C++ autocast kernels once (needs a C++ compiler and ninja; ~15 s); later "
            "emulated audits use them (--kernels)"))
