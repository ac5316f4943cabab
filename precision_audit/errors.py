"""User-facing errors.

Every mistake a user can make (a bad path, a batch the model rejects, an unknown option) raises an
:class:`AuditError` subclass. The CLI prints its message and exits with code 2, without a traceback.
Anything else is a bug: the CLI prints one line and exits with :data:`EXIT_INTERNAL` (3); ``--verbose``
prints its traceback too (README.md, "Exit codes").
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

# The seeds torch's random generators accept (torch.manual_seed): --seed of the audit and of verify.
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1

class AuditError(Exception):
    """A problem with the user's input, explained: what was expected, what was found, how to fix it.

    Example::

        raise BatchError("the batch file could not be read",
                         expected="a file written by torch.save", found="a text file",
                         hint="save the batch with torch.save(batch, 'sample.pt')")
    """

    exit_code = 2

    def __init__(
        self,
        problem: str,
        *,
        expected: str | None = None,
        found: str | None = None,
        choices: Iterable[str] | None = None,
        hint: str | None = None,
    ) -> None:
        self.problem = problem
        self.expected = expected
        self.found = found
        self.choices = tuple(choices) if choices is not None else None
        self.hint = hint
        super().__init__(self.message)

    @property
    def message(self) -> str:
        lines = [self.problem]
        if self.expected:
            lines.append(f"  expected: {self.expected}")
        if self.found:
            lines.append(f"  found:    {self.found}")
        if self.choices:
            lines.append(f"  valid choices: {', '.join(self.choices)}")
        if self.hint:
            lines.append(f"  fix: {self.hint}")
        return "\n".join(lines)


class ModelLoadError(AuditError):
    """The model file or factory could not be turned into an ``nn.Module``."""


class BatchError(AuditError):
    """The sample batch is missing, unreadable, or not something the model accepts."""


class LossError(AuditError):
    """No usable loss could be computed from the model's output."""


class OptionError(AuditError):
    """A command-line or API option has a value outside its allowed set."""


class ModelRunError(AuditError):
    """The user's model raised while the audit ran it (its own error, with the module it happened in)."""


class ModelInUseError(AuditError):
    """The model is being audited already (another thread's audit, or an audit called from inside one)."""


class NumericsError(AuditError):
    """The FP32 reference itself is not finite, so nothing can be compared against it."""


class PolicyError(AuditError):
    """A policy file is malformed, of an unknown version, or made for another model."""


class OutputError(AuditError):
    """The output directory cannot be written."""


#: The exit codes of the command line (README.md, "Exit codes"). 1 means "done, but unsafe as is", never a
#: failure; an internal error (a bug in precision-audit) has its own code so that scripts can tell them apart.
EXIT_OK = 0
EXIT_UNSAFE = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130
#: The reader of the output went away (``precision-audit ... | head``): 128 + SIGPIPE, what a shell reports for a
#: command that a closed pipe ended. The command's files were written as usual; only printed output was dropped.
EXIT_BROKEN_PIPE = 141


#: The oldest torch release precision-audit runs on. The test suite passes on 2.9.1, 2.11.0, 2.12.0 and 2.13.0
#: (docs/development.md, "torch releases"); 2.6 lacks what the audit uses: the ``fp32_precision`` TF32 switches,
#: ``torch.float8_e8m0fnu`` (MX FP8) and FSDP2 on the gloo backend.
MIN_TORCH = (2, 9)


class TorchVersionError(AuditError):
    pass


def check_torch_version(version: str | None = None) -> None:
    """Raise :class:`TorchVersionError` when the installed torch (or ``version``) is older than :data:`MIN_TORCH`
    or missing. Reads the installed package's metadata: torch itself is not imported."""
    import re

    if version is None:
        version = _installed_torch()
        if version is None:
            raise TorchVersionError("torch is not installed", expected=f"torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}",
                                    hint="pip install torch (README.md: the CPU build, or the CUDA build you "
                                         "train with)")
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is not None and (int(m.group(1)), int(m.group(2))) < MIN_TORCH:
        need = f"{MIN_TORCH[0]}.{MIN_TORCH[1]}"
        raise TorchVersionError(f"torch {version} is older than precision-audit supports",
                                expected=f"torch >= {need}", found=f"torch {version}",
                                hint=f"pip install 'torch>={need}' (the build you train with: CPU or your CUDA)")


@functools.cache
def _installed_torch() -> str | None:
    """The version of the torch this process uses: torch's own once imported, else its package metadata (None when
    neither exists). A torch without metadata that can still be imported (a source tree on the path) is imported."""
    import importlib.util
    import sys
    from importlib import metadata

    if "torch" in sys.modules:
        return str(sys.modules["torch"].__version__)
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        if importlib.util.find_spec("torch") is None:
            return None
        import torch

        return str(torch.__version__)
