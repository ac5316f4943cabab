"""Hostile inputs, process side (issue 11, classes 4, 5 and 7): exit codes, Ctrl-C, a misbehaving model file.

Three tables:

- ``CASES``: more of the bad-input catalogue (tests/cli/test_bad_inputs.py's contract, run in-process): each case
  exits with its code (2 for a user error, 3 for an internal error), one message, no traceback (unless
  ``--verbose``), nothing on stdout, and ``--out`` untouched (absent, or the previous audit byte for byte).
- ``MISBEHAVING``: model files that print, write to file descriptor 1, start a child process or change the
  working directory, and still audit fine: stdout carries only the ``--json`` summary, and ``--out``/``--batch``
  mean what they meant before the model was imported.
- ``INTERRUPTS``: a real SIGINT (subprocess + ``os.kill``) at chosen moments: during ``import torch`` (raised
  inside the import machinery), at progress lines, inside the model, twice, after the "interrupted" line, just
  before, during and after the files are moved into place, and during process shutdown. Every one exits 130
  with one "interrupted" line and no traceback, and ``--out`` holds the previous audit untouched or the
  complete new one. A randomized sweep over the whole run is marked slow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import ROOT
from models import LINEAR_BODY, MLP, MLP_BATCH, model_file
from precision_audit.cli import main
from precision_audit.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNSAFE,
    EXIT_USAGE,
    AuditError,
)

HEADER = "import os, sys\nimport torch\nfrom torch import nn\n"
LINEAR = HEADER + LINEAR_BODY
STAGING = ".precision-audit-staging."


def x8(d: Path, name: str = "x8.pt") -> str:
    torch.save(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), d / name)
    return str(d / name)


def on_call(n: int, statement: str, extra: str = "") -> str:
    """A Linear model whose forward runs ``statement`` on its n-th call (1: the FP32 reference; 2: the fp16
    pass); ``n=0``: on every call."""
    cond = "True" if n == 0 else f"self.calls == {n}"
    return HEADER + extra + textwrap.dedent(f"""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if {cond}:
                {statement}
            return self.fc(x)

    def build_model():
        torch.manual_seed(0)
        return M()
    """)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def good_audit(tmp_path_factory) -> Path:
    """One good audit of the MLP sample: the previous results a failed or interrupted run must leave alone."""
    out = tmp_path_factory.mktemp("good") / "audit"
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        assert main([MLP, "--batch", MLP_BATCH, "--out", str(out), "-q", "--steps", "0"]) == 0
    return out


# ---------------------------------------------------------------------------------------------------------------
# the catalogue: exit 2 (user error) or 3 (internal error), one message, --out untouched
# ---------------------------------------------------------------------------------------------------------------


def _fail(exc: BaseException) -> Callable[..., Any]:
    def raiser(*args: Any, **kwargs: Any) -> Any:
        raise exc
    return raiser


def _replace_failing_on(n: int) -> Callable[[pytest.MonkeyPatch], None]:
    """os.replace raises on its n-th call: a commit that fails half way must be undone."""
    def patch(mp: pytest.MonkeyPatch) -> None:
        real, count = os.replace, [0]

        def replace(src: Any, dst: Any) -> None:
            count[0] += 1
            if count[0] == n:
                raise OSError(28, "No space left on device")
            real(src, dst)
        mp.setattr(os, "replace", replace)
    return patch


def _options(**fields: Any) -> Callable[[Path], Callable[[], Any]]:
    def build(d: Path) -> Callable[[], Any]:
        from precision_audit.audit import AuditOptions

        return lambda: AuditOptions(**{"model": MLP, **fields})
    return build


def _verify_exit(d: Path) -> list[str]:
    """`verify` with a model (the MLP sample itself, so the policy matches) whose forward calls sys.exit(7)."""
    from precision_audit.audit import AuditOptions, run_audit

    run_audit(AuditOptions(model=MLP, batch=MLP_BATCH, out=d / "policy-audit", steps=0))
    model = model_file(d, f"""
    import sys, importlib.util
    spec = importlib.util.spec_from_file_location("mlp_sample", {MLP!r})
    mlp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mlp)

    def build_model():
        m = mlp.build_model()
        m.forward = lambda *a, **k: sys.exit(7)
        return m
    """)
    return ["verify", model, "--batch", MLP_BATCH, "--policy", str(d / "policy-audit" / "policy.json"),
            "--steps", "2"]


@dataclasses.dataclass(frozen=True)
class Case:
    """``build(d)`` writes the case's files into ``d`` and returns the CLI arguments (``--out``, ``--steps 0``
    and ``-q`` are added unless given) or a callable (an API case: it must raise an AuditError)."""

    id: str
    build: Callable[[Path], list[str] | Callable[[], Any]]
    words: tuple[str, ...]
    code: int = EXIT_USAGE
    prev_good: bool = False
    patch: Callable[[pytest.MonkeyPatch], None] | None = None
    one_message: bool = True  # False: the user's own code printed something first (its argparse usage)


def _internal_words(*extra: str) -> tuple[str, ...]:
    return ("precision-audit: internal error (exit 3)", "--verbose", *extra)


CASES: list[Case] = [
    # --- the model calls sys.exit() (class 7) --------------------------------------------------------------------
    Case("sys-exit-5-in-forward", lambda d: [model_file(d, on_call(2, "sys.exit(5)")), "--batch", x8(d)],
         ("the model called sys.exit(5)", "model.py, line", "sys.exit(5)", "remove the sys.exit() call"),
         prev_good=True),
    Case("sys-exit-0-in-forward-is-not-success",
         lambda d: [model_file(d, on_call(1, "sys.exit(0)")), "--batch", x8(d)],
         ("the model called sys.exit(0)", "model.py, line")),
    Case("sys-exit-1-in-forward-is-not-unsafe",
         lambda d: [model_file(d, on_call(1, "sys.exit(1)")), "--batch", x8(d)], ("called sys.exit(1)",)),
    Case("sys-exit-no-argument-in-forward",
         lambda d: [model_file(d, on_call(2, "sys.exit()")), "--batch", x8(d)], ("called sys.exit(None)",)),
    Case("sys-exit-message-in-forward",
         lambda d: [model_file(d, on_call(1, "sys.exit('bye')")), "--batch", x8(d)], ("called sys.exit('bye')",)),
    Case("raise-system-exit-in-backward",
         lambda d: [model_file(d, HEADER + textwrap.dedent("""
         class Quit(torch.autograd.Function):
             @staticmethod
             def forward(ctx, x):
                 return x * 1.0
             @staticmethod
             def backward(ctx, g):
                 raise SystemExit(9)
         class M(nn.Module):
             def __init__(self):
                 super().__init__()
                 self.fc = nn.Linear(8, 4)
             def forward(self, x):
                 return Quit.apply(self.fc(x))
         def build_model():
             return M()
         """)), "--batch", x8(d)],
         ("called sys.exit(9)", "model.py, line", "raise SystemExit(9)")),
    Case("sys-exit-in-loss-fn",
         lambda d: [model_file(d, LINEAR + "def loss_fn(output, batch):\n    sys.exit(6)\n"), "--batch", x8(d)],
         ("called sys.exit(6)", "model.py, line 8")),
    Case("sys-exit-in-sample-batch",
         lambda d: [model_file(d, LINEAR + "def sample_batch():\n    sys.exit(4)\n")],
         ("called sys.exit(4)", "model.py, line 8")),
    Case("sys-exit-in-build-model",
         lambda d: [model_file(d, HEADER + "def build_model():\n    sys.exit(3)\n"), "--batch", x8(d)],
         ("calling build_model() from model.py raised SystemExit: 3", "sys.exit(3)", "model.py, line 5")),
    Case("sys-exit-at-import-with-a-code",
         lambda d: [model_file(d, HEADER + "sys.exit(12)\n"), "--batch", x8(d)],
         ("importing model.py raised SystemExit: 12", "called sys.exit(12)", "model.py, line 4",
          "if __name__ == '__main__'")),
    Case("argparse-at-import",
         lambda d: [model_file(d, HEADER + "import argparse\np = argparse.ArgumentParser()\n"
                                           "p.add_argument('--config', required=True)\nARGS = p.parse_args()\n"),
                    "--batch", x8(d)],
         ("importing model.py raised SystemExit: 2", "model.py, line 7", "ARGS = p.parse_args()"),
         one_message=False),
    Case("sys-exit-in-verify-forward", _verify_exit, ("the model called sys.exit(7)", "model.py, line")),
    # --- the meta device (class 4) ---------------------------------------------------------------------------------
    Case("model-on-meta-device",
         lambda d: [model_file(d, HEADER + "def build_model():\n    with torch.device('meta'):\n"
                                           "        return nn.Linear(8, 4)\n"), "--batch", x8(d)],
         ("on the meta device", "2 of 2 parameter/buffer tensors on meta: weight, bias", "to_empty(device='cpu')",
          "not supported"), prev_good=True),
    Case("model-buffer-on-meta-device",
         lambda d: [model_file(d, HEADER + "def build_model():\n    m = nn.Linear(8, 4)\n"
                                           "    m.register_buffer('scale', torch.ones(4, device='meta'))\n"
                                           "    return m\n"), "--batch", x8(d)],
         ("on the meta device", "1 of 3 parameter/buffer tensors on meta: scale")),
    Case("batch-on-meta-device",
         lambda d: [model_file(d, LINEAR + "def sample_batch():\n    return torch.ones(4, 8, device='meta')\n")],
         ("holds tensors on the meta device", "args[0]", "on the CPU")),
    # --- options (class 4) ----------------------------------------------------------------------------------------
    Case("seed-above-torch-range", lambda d: [MLP, "--batch", MLP_BATCH, "--seed", str(2 ** 64)],
         ("--seed is outside the range", "18446744073709551615", "18446744073709551616"), prev_good=True),
    Case("seed-below-torch-range", lambda d: [MLP, "--batch", MLP_BATCH, "--seed", str(-(2 ** 63) - 1)],
         ("--seed is outside the range", "-9223372036854775808")),
    Case("api-out-is-an-int", _options(out=3), ("AuditOptions.out has the wrong type", "int: 3")),
    Case("api-out-is-empty", _options(out=""), ("AuditOptions.out", "not empty")),
    Case("api-model-is-none", _options(model=None), ("AuditOptions.model has the wrong type", "NoneType")),
    Case("api-batch-is-a-tensor", _options(batch=torch.ones(2)), ("AuditOptions.batch has the wrong type",
                                                                  "Tensor")),
    Case("api-formats-are-ints", _options(formats=[16]), ("AuditOptions.formats has the wrong type", "(16,)")),
    Case("api-seed-is-a-string", _options(seed="0"), ("AuditOptions.seed has the wrong type", "str: '0'")),
    Case("api-seed-is-a-bool", _options(seed=True), ("AuditOptions.seed has the wrong type", "bool")),
    Case("api-seed-too-large", _options(seed=2 ** 64), ("outside the range",)),
    Case("api-emulate-is-a-string", _options(emulate="no"), ("AuditOptions.emulate", "True or False")),
    Case("api-budget-is-a-dict", _options(budget={"loss": 0.1}), ("AuditOptions.budget", "Budget")),
    Case("api-target-is-an-int", _options(target=100), ("AuditOptions.target", "int: 100")),
    # --- --out (class 4) -------------------------------------------------------------------------------------------
    Case("out-holds-a-file-named-tb", lambda d: [MLP, "--batch", MLP_BATCH],
         ("holds a file named tb", "where the audit writes a folder", "remove or rename"), prev_good=True),
    Case("out-holds-a-file-named-tb-audit", lambda d: [MLP, "--batch", MLP_BATCH],
         ("holds a file named tb/audit",), prev_good=True),
    Case("commit-fails-half-way", lambda d: [model_file(d, LINEAR), "--batch", x8(d)],
         ("could not write the results", "No space left on device"), prev_good=True, patch=_replace_failing_on(4)),
    # --- internal errors: exit 3, one line, the previous audit untouched ------------------------------------------
    Case("internal-error-in-the-analysis", lambda d: [MLP, "--batch", MLP_BATCH],
         _internal_words("ZeroDivisionError: boom"), code=EXIT_INTERNAL, prev_good=True,
         patch=lambda mp: mp.setattr("precision_audit.planning.second_order.analyse",
                                     _fail(ZeroDivisionError("boom")))),
    Case("internal-error-rendering-html", lambda d: [MLP, "--batch", MLP_BATCH],
         _internal_words("KeyError"), code=EXIT_INTERNAL, prev_good=True,
         patch=lambda mp: mp.setattr("precision_audit.report.html.render_audit_json", _fail(KeyError("layers")))),
    Case("internal-error-writing-tensorboard-events", lambda d: [model_file(d, LINEAR), "--batch", x8(d)],
         _internal_words("RuntimeError: event writer"), code=EXIT_INTERNAL, prev_good=True,
         patch=lambda mp: mp.setattr("precision_audit.report.tensorboard._events",
                                     _fail(RuntimeError("event writer")))),
    Case("internal-error-verbose-shows-the-traceback", lambda d: [MLP, "--batch", MLP_BATCH, "--verbose"],
         ("Traceback (most recent call last)", "ZeroDivisionError: boom",
          "precision-audit: internal error (exit 3)"), code=EXIT_INTERNAL, prev_good=True, one_message=False,
         patch=lambda mp: mp.setattr("precision_audit.planning.second_order.analyse",
                                     _fail(ZeroDivisionError("boom")))),
]


def test_catalogue_ids_are_unique_and_the_table_is_large():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    assert len(CASES) >= 30


@dataclasses.dataclass
class Outcome:
    code: int
    err: str
    out: str
    out_dir: Path
    before: dict[str, bytes] | None


def _run(case: Case, d: Path, good_audit: Path) -> Outcome:
    out_dir = d / "out"
    before = None
    if case.prev_good:
        shutil.copytree(good_audit, out_dir)
        if case.id == "out-holds-a-file-named-tb":
            shutil.rmtree(out_dir / "tb")
            (out_dir / "tb").write_text("not a folder\n")
        if case.id == "out-holds-a-file-named-tb-audit":
            shutil.rmtree(out_dir / "tb" / "audit")
            (out_dir / "tb" / "audit").write_text("not a folder\n")
        before = _snapshot(out_dir)
    err, out = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(d)
    try:
        with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            action = case.build(d)
            if case.patch:
                case.patch(mp)
            if callable(action):
                try:
                    action()
                    code = 0
                except AuditError as e:
                    print(f"precision-audit: error: {e.message}", file=sys.stderr)
                    code = e.exit_code
            else:
                argv = list(action)
                argv += [] if "--out" in argv else ["--out", str(out_dir)]
                argv += [] if "--steps" in argv else ["--steps", "0"]
                try:
                    code = main(argv + ["--quiet"])
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(cwd)
    return Outcome(code, err.getvalue(), out.getvalue(), out_dir, before)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, good_audit) -> Callable[[Case], Outcome]:
    cache: dict[str, Outcome] = {}

    def run(case: Case) -> Outcome:
        if case.id not in cache:
            cache[case.id] = _run(case, tmp_path_factory.mktemp(case.id), good_audit)
        return cache[case.id]
    return run


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_hostile_input_exit_code_message_and_out_untouched(outcomes, case: Case):
    o = outcomes(case)
    assert o.code == case.code, f"exit code {o.code}; stderr:\n{o.err}"
    if "Traceback (most recent call last)" not in case.words:
        assert "Traceback" not in o.err, o.err
    for word in case.words:
        assert word in o.err, f"{word!r} missing from the message:\n{o.err}"
    assert o.out == "", f"nothing on stdout for a failed run, got:\n{o.out}"
    if o.before is not None:
        assert _snapshot(o.out_dir) == o.before, "the previous audit in --out was changed"
    else:
        assert not o.out_dir.exists(), "a failed run creates no --out folder"
    leftovers = [p for p in o.out_dir.parent.rglob("*") if p.name.endswith(".tmp") or p.name.startswith(STAGING)]
    assert not leftovers, f"temporary files left behind: {leftovers}"


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES if c.one_message])
def test_hostile_input_message_is_one_message(outcomes, case: Case):
    o = outcomes(case)
    lines = o.err.rstrip("\n").splitlines()
    if case.code == EXIT_INTERNAL:
        assert len(lines) == 1, f"an internal error is one line without --verbose:\n{o.err}"
        return
    errors = [L for L in lines if L.startswith("precision-audit: error:")]
    assert len(errors) == 1 and lines[0] == errors[0], f"one error line, first:\n{o.err}"
    assert sum(L.lstrip().startswith("fix:") for L in lines) <= 1, o.err


def test_seed_at_both_ends_of_torchs_range_is_accepted(tmp_path):
    """The boundary next to the rejected cases above: the extreme seeds torch accepts run."""
    from precision_audit.audit import AuditOptions

    for seed in (2 ** 64 - 1, -(2 ** 63)):
        AuditOptions(model=MLP, seed=seed)
        torch.manual_seed(seed)  # the independent reference: torch takes it
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert main([MLP, "--batch", MLP_BATCH, "--out", str(tmp_path / "o"), "-q", "--steps", "0",
                     "--seed", str(2 ** 64 - 1)]) in (EXIT_OK, EXIT_UNSAFE), err.getvalue()


def test_api_accepts_str_and_pathlike_paths(tmp_path, monkeypatch):
    from precision_audit.audit import AuditOptions, run_audit
    from precision_audit.formats import Format

    opts = AuditOptions(model=Path(MLP), batch=Path(MLP_BATCH), out=str(tmp_path / "a"), steps=0,
                        formats=["fp16", "bf16"])
    assert opts.out == tmp_path / "a" and isinstance(opts.out, Path)
    assert opts.model == MLP and opts.batch == MLP_BATCH and opts.formats == (Format.FP16, Format.BF16)
    assert AuditOptions(model=MLP, formats="bf16").formats == (Format.BF16,)
    monkeypatch.chdir(tmp_path)
    result = run_audit(AuditOptions(model=MLP, batch=MLP_BATCH, out="rel-out", steps=0))
    assert result.files[0] == Path("rel-out") / "audit.json"
    assert json.loads((tmp_path / "rel-out" / "audit.json").read_text())["options"]["out"] == "rel-out"


# ---------------------------------------------------------------------------------------------------------------
# the model misbehaves but the audit goes through: stdout stays the JSON summary, paths keep their meaning
# ---------------------------------------------------------------------------------------------------------------

NOISY = "print('hello from import')\n"


@dataclasses.dataclass(frozen=True)
class Misbehaving:
    id: str
    body: str                       # the model file
    on_stderr: tuple[str, ...]      # the model's own output, moved to stderr
    subprocess: bool = False        # file descriptor 1 and child processes: only a real process shows them


MISBEHAVING = [
    Misbehaving("prints-at-import", LINEAR + NOISY, ("hello from import",)),
    Misbehaving("prints-in-forward", on_call(0, "print('forward', self.calls)"), ("forward 1", "forward 2")),
    Misbehaving("prints-in-build-model-and-loss-fn",
                HEADER + "def build_model():\n    print('building')\n    return nn.Linear(8, 4)\n"
                "def loss_fn(out, batch):\n    print('loss!')\n    return out.float().pow(2).mean()\n",
                ("building", "loss!")),
    Misbehaving("chdir-at-import", LINEAR + "os.chdir(os.path.join(os.path.dirname(__file__), 'elsewhere'))\n",
                ()),
    Misbehaving("chdir-in-forward",
                on_call(1, "os.chdir(os.path.join(os.path.dirname(__file__), 'elsewhere'))"), ()),
    Misbehaving("writes-to-fd-1-a-child-process-and-logs-to-stdout",
                on_call(1, "os.write(1, b'raw fd write\\n'); os.system('echo from a child')") + NOISY
                + "import logging\nlogging.basicConfig(stream=sys.stdout, level=logging.INFO, force=True)\n"
                "logging.getLogger('user').info('configured')\n",
                ("raw fd write", "from a child", "hello from import", "configured"), subprocess=True),
]


def _cli_process(args: list[str], cwd: Path, prelude: str = "", **popen: Any) -> subprocess.Popen:
    """``main()`` as the console script runs it (no arguments: it ends the process itself)."""
    prog = prelude + "\nfrom precision_audit.cli import main\nmain()\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", prog, *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in MISBEHAVING])
def test_misbehaving_model_keeps_stdout_json_and_paths(tmp_path, case: Misbehaving):
    (tmp_path / "elsewhere").mkdir()
    model_file(tmp_path, case.body)
    x8(tmp_path)
    args = ["model.py", "--batch", "x8.pt", "--out", "out", "--steps", "0", "--json", "-q"]  # relative paths
    if case.subprocess:
        p = _cli_process(args, tmp_path)
        out, err = p.communicate(timeout=300)
        code = p.returncode
    else:
        o, e = io.StringIO(), io.StringIO()
        cwd = os.getcwd()
        os.chdir(tmp_path)
        try:
            with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
                code = main(args)
        finally:
            os.chdir(cwd)
        out, err = o.getvalue(), e.getvalue()
    assert code in (EXIT_OK, EXIT_UNSAFE), err
    summary = json.loads(out)  # stdout is nothing but the JSON summary
    assert summary["files"][0] == "out/audit.json"
    for text in case.on_stderr:
        assert text in err
    assert json.loads((tmp_path / "out" / "audit.json").read_text())["model"]["class"] in ("Linear", "M")
    assert not list((tmp_path / "elsewhere").iterdir()), "relative --out followed the model's os.chdir"


def test_stdout_closed_by_its_reader_is_not_an_internal_error(tmp_path):
    """`precision-audit ... | head -0`: the audit is written and its verdict is the exit code, not exit 3."""
    p = _cli_process([model_file(tmp_path, LINEAR), "--batch", x8(tmp_path), "--out", str(tmp_path / "out"),
                      "-q", "--steps", "0"], tmp_path)
    assert p.stdout is not None
    p.stdout.close()  # the reader is gone before anything is printed
    err = p.stderr.read() if p.stderr else ""
    assert p.wait(timeout=300) in (EXIT_OK, EXIT_UNSAFE), err
    assert "internal error" not in err and "Traceback" not in err, err
    assert (tmp_path / "out" / "audit.json").is_file()


def test_concurrent_commits_into_one_folder_do_not_interleave(tmp_path, monkeypatch):
    """Two writers commit three files each into the same folder at once, with every move slowed down so that
    they would interleave: afterwards the three files come from one writer."""
    import threading

    from precision_audit.outputs import write_files

    real = os.replace

    def slow_replace(src: Any, dst: Any) -> None:
        time.sleep(0.02)
        real(src, dst)

    monkeypatch.setattr(os, "replace", slow_replace)
    out = tmp_path / "out"
    out.mkdir()
    errors: list[BaseException] = []

    def writer(tag: str) -> None:
        try:
            for _ in range(3):
                write_files(out, {name: f"{tag}\n" for name in ("audit.json", "policy.json", "report.html")})
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(tag,)) for tag in ("A", "B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    contents = {p.read_text() for p in out.iterdir() if p.is_file()}
    assert len(contents) == 1, f"a mix of two writers: {contents}"
    assert sorted(p.name for p in out.iterdir()) == ["audit.json", "policy.json", "report.html"]


# ---------------------------------------------------------------------------------------------------------------
# Ctrl-C: a real SIGINT at chosen moments
# ---------------------------------------------------------------------------------------------------------------

def _import_hook(module: str, times: int = 1) -> str:
    """A SIGINT (``times`` of them) sent when ``module`` starts to be imported: KeyboardInterrupt inside the
    import machinery."""
    return textwrap.dedent(f"""
    import importlib.abc, os, signal, sys
    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == {module!r}:
                for _ in range({times}):
                    os.kill(os.getpid(), signal.SIGINT)
            return None
    sys.meta_path.insert(0, _Hook())
    """)


def _wrap(target: str, attribute: str, *, when: str = "before", times: int = 1, match: str = "") -> str:
    """SIGINT(s) sent ``before`` or ``after`` a call of ``target.attribute`` whose first argument's base name
    starts with ``match``."""
    return textwrap.dedent(f"""
    import importlib, os, signal
    _mod = importlib.import_module({target.rsplit(':', 1)[0]!r})
    _owner = _mod
    for _part in {target.rsplit(':', 1)[1:]!r}:
        _owner = getattr(_owner, _part)
    _real = getattr(_owner, {attribute!r})
    def _kill():
        for _ in range({times}):
            os.kill(os.getpid(), signal.SIGINT)
    def _wrapped(*a, **k):
        hit = os.path.basename(str(a[0] if a else "")).startswith({match!r})
        if hit and {when!r} == "before":
            _kill()
        r = _real(*a, **k)
        if hit and {when!r} == "after":
            _kill()
        return r
    setattr(_owner, {attribute!r}, _wrapped)
    """)


AT_EXIT = "import atexit, os, signal\natexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))\n"
AFTER_INTERRUPTED_LINE = textwrap.dedent("""
    import os, signal, sys
    class _Err:
        def __init__(self, s): self._s = s
        def write(self, t):
            n = self._s.write(t)
            if "interrupted" in t:
                for _ in range(3):
                    os.kill(os.getpid(), signal.SIGINT)
            return n
        def __getattr__(self, name): return getattr(self._s, name)
    sys.stderr = _Err(sys.stderr)
    """)
IN_FORWARD = on_call(2, "os.kill(os.getpid(), signal.SIGINT)", "import signal\n")


@dataclasses.dataclass(frozen=True)
class Interrupt:
    """``prelude``: Python run before ``main()``; ``line``: send the SIGINT when this progress line appears on
    stderr instead; ``expect``: what --out must hold afterwards ("old", "new" or "either")."""

    id: str
    expect: str
    prelude: str = ""
    line: str | None = None
    model: str = LINEAR
    entry: str = "main"  # or "console-script", "python-m"
    slow: bool = False


INTERRUPTS = [
    Interrupt("during-import-torch", "old", _import_hook("torch")),
    Interrupt("during-import-torch-three-times", "old", _import_hook("torch", 3)),
    Interrupt("during-import-torch-C-extension", "old", _import_hook("torch._C"), slow=True),
    # the events are written without importing tensorboard (report/event_file.py): the SIGINT arrives as they start
    Interrupt("while-staging-before-the-event-file", "old",
              _wrap("precision_audit.report.tensorboard", "write_scalars"), slow=True),
    Interrupt("at-progress-line-fp32-reference", "old", line="FP32 reference pass"),
    Interrupt("at-progress-line-analysing", "old", line="analysing", slow=True),
    Interrupt("inside-the-model-forward", "old", model=IN_FORWARD, slow=True),
    Interrupt("again-while-the-model-is-put-back", "old",
              _wrap("precision_audit.capture:CaptureSession", "__exit__", times=2), model=IN_FORWARD),
    Interrupt("again-after-the-interrupted-line", "old", AFTER_INTERRUPTED_LINE + _import_hook("torch")),
    Interrupt("again-after-the-interrupted-line-from-the-model", "old", AFTER_INTERRUPTED_LINE, model=IN_FORWARD,
              slow=True),
    Interrupt("just-before-the-files-move", "old", _wrap("precision_audit.outputs:Staging", "commit")),
    Interrupt("between-two-file-moves", "new", _wrap("os", "replace", match="report.html")),
    Interrupt("while-the-staging-folder-is-removed", "new",
              _wrap("shutil", "rmtree", match=STAGING, times=2)),
    Interrupt("during-process-shutdown", "new", AT_EXIT),
    Interrupt("console-script-at-progress-line", "old", line="FP32 reference pass", entry="console-script"),
    Interrupt("python-m-at-progress-line", "old", line="target ", entry="python-m", slow=True),
]


def _launch(case: Interrupt, args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if case.entry == "console-script":
        script = Path(sys.executable).with_name("precision-audit")
        if not script.exists():
            pytest.skip("no precision-audit console script beside this Python")
        cmd = [str(script), *args]
    elif case.entry == "python-m":
        cmd = [sys.executable, "-m", "precision_audit", *args]
    else:
        return _cli_process(args, cwd, case.prelude)
    return subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _interrupted_run(case: Interrupt, d: Path, good_audit: Path) -> tuple[int, str, str, Path, dict]:
    out = d / "out"
    shutil.copytree(good_audit, out)
    before = _snapshot(out)
    model = model_file(d, case.model)
    args = [model, "--batch", x8(d), "--out", str(out), "--steps", "0"] + ([] if case.line else ["-q"])
    p = _launch(case, args, d)
    err_lines: list[str] = []
    if case.line is not None:
        assert p.stderr is not None
        for text in p.stderr:
            err_lines.append(text)
            if case.line in text:
                p.send_signal(signal.SIGINT)
                break
    stdout, rest = p.communicate(timeout=300)
    return p.returncode, stdout, "".join(err_lines) + rest, out, before


def _check_out(out: Path, before: dict[str, bytes], expect: str) -> str:
    """'old' when --out is the previous audit byte for byte, 'new' when every old file was replaced by a
    complete new audit (of the Linear model); anything else fails."""
    after = _snapshot(out)
    leftovers = [p for p in out.rglob("*") if p.name.startswith(STAGING) or p.name.endswith(".tmp")]
    assert not leftovers, f"left behind: {leftovers}"
    if after == before:
        state = "old"
    else:
        assert not set(before) & set(after) - {"audit.json", "policy.json", "report.html"}, "old events kept"
        assert all(after.get(k) != before[k] for k in before), "a mix of the old and the new audit"
        audit = json.loads(after["audit.json"])
        assert audit["model"]["class"] == "Linear"
        assert json.loads(after["policy.json"])["model"]["class"] == "Linear"
        assert after["report.html"].rstrip().endswith(b"</html>")
        assert len([k for k in after if k.startswith("tb/audit/events.out.tfevents.")]) == 1
        state = "new"
    assert expect in ("either", state), f"--out holds the {state} audit, expected {expect}"
    return state


def _check_interrupted(code: int, err: str) -> None:
    assert code == EXIT_INTERRUPTED, f"exit {code}; stderr:\n{err}"
    assert "Traceback" not in err and "Exception ignored" not in err, err
    lines = [L for L in err.splitlines() if "interrupted" in L]
    assert len(lines) == 1 and lines[0].startswith("precision-audit: interrupted"), err
    assert err.rstrip("\n").splitlines()[-1] == lines[0], f"the interrupted line is the last one:\n{err}"


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.slow else [])
                                  for c in INTERRUPTS])
def test_ctrl_c_exits_130_with_one_line_and_a_consistent_out(tmp_path, good_audit, case: Interrupt):
    code, stdout, err, out, before = _interrupted_run(case, tmp_path, good_audit)
    _check_interrupted(code, err)
    if case.id != "during-process-shutdown":  # that one comes after the summary was printed
        assert stdout == ""
    _check_out(out, before, case.expect)


@pytest.mark.slow
def test_ctrl_c_at_random_moments(tmp_path, good_audit):
    """SIGINT after random delays over a whole run of the console script (from the moment precision-audit's
    code runs: a Ctrl-C while Python itself starts is Python's, README.md "Exit codes")."""
    script = Path(sys.executable).with_name("precision-audit")
    if not script.exists():
        pytest.skip("no precision-audit console script beside this Python")
    model, batch = model_file(tmp_path, LINEAR), x8(tmp_path)
    t0 = time.perf_counter()
    subprocess.run([str(script), model, "--batch", batch, "--out", str(tmp_path / "warm"), "-q", "--steps", "0"],
                   check=True, capture_output=True, timeout=300)
    total = time.perf_counter() - t0
    rng = random.Random(11)
    states = []
    for i in range(12):
        out = tmp_path / f"out{i}"
        shutil.copytree(good_audit, out)
        before = _snapshot(out)
        p = subprocess.Popen([str(script), model, "--batch", batch, "--out", str(out), "-q", "--steps", "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started = time.perf_counter()
        _wait_until_main_runs(p)
        time.sleep(rng.uniform(0, total * 1.1 - (time.perf_counter() - started)))
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
        stdout, err = p.communicate(timeout=300)
        if p.returncode in (EXIT_OK, EXIT_UNSAFE) and "interrupted" not in err:  # ended before the SIGINT
            states.append("finished")
            _check_out(out, before, "new")
            continue
        _check_interrupted(p.returncode, err)
        states.append(_check_out(out, before, "either"))
    print(f"random SIGINTs over a {total:.1f} s run: "
          + ", ".join(f"{s} {states.count(s)}" for s in sorted(set(states))))
    assert states.count("old") >= 3, states


def _wait_until_main_runs(p: subprocess.Popen) -> None:
    """Until main() runs: torch's library is mapped (/proc/PID/maps), and only main() imports torch."""
    maps = Path(f"/proc/{p.pid}/maps")
    deadline = time.perf_counter() + 60
    while time.perf_counter() < deadline and p.poll() is None:
        try:
            if "libtorch" in maps.read_text():
                return
        except OSError:
            return
        time.sleep(0.005)


# ---------------------------------------------------------------------------------------------------------------
# the exit codes are documented where users look
# ---------------------------------------------------------------------------------------------------------------


def test_exit_codes_are_documented_in_readme_and_help():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Exit codes", 1)[1].split("\n#", 1)[0]
    rows = dict(re.findall(r"^\|\s*`?(\d+)`?\s*\|(.+)\|\s*$", section, flags=re.M))
    assert set(map(int, rows)) == {EXIT_OK, EXIT_UNSAFE, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE}
    assert "internal" in rows[str(EXIT_INTERNAL)] and "--verbose" in rows[str(EXIT_INTERNAL)]
    from precision_audit.cli import EPILOG

    for code in ("0 done", "1 unsafe", "2 bad input", "3 internal error", "130 interrupted", "141 output pipe"):
        assert code in EPILOG
    import precision_audit.cli as cli

    assert "3: an internal error" in cli.__doc__ and "130: interrupted" in cli.__doc__


def test_a_reader_closing_the_pipe_ends_the_command_quietly():
    """``precision-audit targets | head`` where head has gone: exit 141 (what a shell reports for a closed pipe),
    no "internal error", no traceback, no "Exception ignored" from the interpreter's last flush (it was exit 3
    "internal error: BrokenPipeError"). The reader's end is closed before the command writes anything."""
    with subprocess.Popen([sys.executable, "-m", "precision_audit", "targets"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, cwd=ROOT) as p:
        p.stdout.close()
        err = p.stderr.read().decode()
        code = p.wait(timeout=120)
    assert code == EXIT_BROKEN_PIPE, err
    assert err.strip() == "", err
