"""The command line's one registry of commands and its one error-to-exit-code path (precision_audit/cli/).

The error path is driven through a command registered for the test only (``boom``), whose function raises
what the test chooses: every AuditError subclass must end as exit 2 with one message and no traceback, a bug
as exit 3, the user's ``sys.exit()`` as exit 2, Ctrl-C as 130.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import precision_audit.cli.report  # noqa: F401  (defines ReportInputError, an AuditError of its own)
from precision_audit import errors
from precision_audit.cli import EPILOG, main
from precision_audit.cli import commands as registry
from precision_audit.cli.commands import AUDIT, Command, find, register

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())  # the repository
EXPECTED = {"targets", "verify", "report", "diff", "export", "build-kernels"}

#: What the ``boom`` command raises (set by each test).
_RAISE: list[BaseException] = []


def _boom(argv: list[str]) -> int:
    raise _RAISE[0]


def _exit_from_user_code(argv: list[str]) -> int:
    sys.exit(7)  # as a model's forward would: not precision-audit's own SystemExit


@pytest.fixture
def boom(monkeypatch: pytest.MonkeyPatch):
    """Register ``boom`` (this module's :func:`_boom`) for one test; the registry is restored afterwards."""
    monkeypatch.setitem(registry._REGISTRY, "boom", Command("boom", f"{__name__}:_boom", "precision-audit boom", "t"))

    def run(exc: BaseException) -> int:
        _RAISE[:] = [exc]
        return main(["boom", "--verbose"] if isinstance(exc, KeyError) else ["boom"])

    return run


def _all_subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_all_subclasses(sub)]
    return out


# --- the registry ----------------------------------------------------------------------------------------------


def test_every_command_is_registered_once_and_loads():
    names = [c.name for c in registry.commands()]
    assert sorted(names) == sorted(EXPECTED), "the commands with a word of their own"
    assert len(names) == len(set(names))
    for c in (AUDIT, *registry.commands()):
        fn = c.load()
        assert callable(fn), f"{c.run} must name a function"
        assert c.usage in EPILOG or c is AUDIT, f"--help must list {c.name}"


def test_registering_a_word_twice_is_an_error():
    with pytest.raises(ValueError, match="registered twice"):
        register(Command("report", "precision_audit.cli.report:report_main", "u", "s"))
    assert find(["report"])[0].run == "precision_audit.cli.report:report_main", "the first one still holds"


@pytest.mark.parametrize("run, name", [("no_colon", "x"), ("m:not an identifier", "x"), ("m:f", "--flag"),
                                       ("m:f", "two words")], ids=["no-colon", "bad-function", "option", "space"])
def test_a_malformed_command_is_refused(run, name):
    with pytest.raises(ValueError):
        Command(name, run, "u", "s")


@pytest.mark.parametrize("argv, name, rest", [
    (["targets"], "targets", []),
    (["verify", "m.py", "--policy", "p"], "verify", ["m.py", "--policy", "p"]),
    (["build-kernels", "-v"], "build-kernels", ["-v"]),
    (["verify.py", "--batch", "b.pt"], "", ["verify.py", "--batch", "b.pt"]),  # a model file, not a command
    (["", "--batch", "b.pt"], "", ["", "--batch", "b.pt"]),
    ([], "", []),
], ids=["targets", "verify", "build-kernels", "model-named-verify", "empty-word", "nothing"])
def test_find_takes_the_first_word_only_when_it_is_a_command(argv, name, rest):
    command, args = find(argv)
    assert (command.name, args) == (name, rest)


def test_a_command_usage_error_is_argparse_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["targets", "extra"])
    assert info.value.code == 2
    assert "unrecognized arguments: extra" in capsys.readouterr().err


# --- the one error path ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [errors.AuditError, *_all_subclasses(errors.AuditError)], ids=lambda c: c.__name__)
def test_every_audit_error_is_exit_2_with_one_message(boom, capsys, cls):
    assert cls.exit_code == errors.EXIT_USAGE
    code = boom(cls("the problem", expected="this", found="that", hint="do so"))
    err = capsys.readouterr().err
    assert code == errors.EXIT_USAGE
    assert err.startswith("precision-audit: error: the problem\n") and "  fix: do so" in err
    assert "Traceback" not in err


def test_a_bug_is_exit_3_in_one_line(boom, capsys):
    code = boom(ZeroDivisionError("division by zero"))
    err = capsys.readouterr().err
    assert code == errors.EXIT_INTERNAL
    assert err.count("\n") == 1 and "internal error (exit 3): ZeroDivisionError: division by zero" in err
    assert "--verbose" in err and "Traceback" not in err


def test_a_bug_with_verbose_shows_the_traceback(boom, capsys):
    code = boom(KeyError("k"))  # the fixture passes --verbose for a KeyError
    err = capsys.readouterr().err
    assert code == errors.EXIT_INTERNAL
    assert "Traceback" in err and "_boom" in err and "this is a bug in precision-audit" in err


def test_out_of_memory_is_a_user_error_for_any_command(boom, capsys):
    code = boom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"))
    err = capsys.readouterr().err
    assert code == errors.EXIT_USAGE
    assert "ran out of memory during precision-audit boom" in err and "smaller batch" in err
    assert "Tried to allocate 20.00 GiB" in err and "Traceback" not in err


def test_an_empty_out_of_memory_message_is_still_one_message(boom, capsys):
    assert boom(torch.OutOfMemoryError()) == errors.EXIT_USAGE
    assert "found:    OutOfMemoryError" in capsys.readouterr().err


def test_sys_exit_from_user_code_is_exit_2_naming_the_line(monkeypatch, capsys):
    monkeypatch.setitem(registry._REGISTRY, "boom",
                        Command("boom", f"{__name__}:_exit_from_user_code", "precision-audit boom", "t"))
    assert main(["boom"]) == errors.EXIT_USAGE
    err = capsys.readouterr().err
    assert "called sys.exit(7)" in err and "test_cli_registry.py, line" in err and "sys.exit(7)" in err


def test_ctrl_c_is_130(boom, capsys):
    assert boom(KeyboardInterrupt()) == errors.EXIT_INTERRUPTED
    assert "interrupted" in capsys.readouterr().err


# --- entry points ----------------------------------------------------------------------------------------------


def test_console_script_points_at_main():
    (script,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "precision-audit"]
    assert script.value == "precision_audit.cli:main" and script.load() is main


def test_the_cli_package_imports_no_torch():
    code = "import sys, precision_audit.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


@pytest.mark.parametrize("module", ["precision_audit", "precision_audit.cli"])
def test_python_dash_m_runs_a_command(module):
    run = subprocess.run([sys.executable, "-m", module, "targets", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert run.returncode == 0 and "usage: precision-audit targets" in run.stdout
