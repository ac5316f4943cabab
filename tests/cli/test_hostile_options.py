"""Hostile options (issue 11, class 8): an empty ``--target``, unbounded ``--steps``, a ``--budget`` key given
twice, and ``verify`` whose policy arm fails.

``CASES`` is part of the bad-input catalogue (tests/cli/test_bad_inputs.py): each runs the real CLI
(``precision_audit.cli.main``) and must exit 2 with one message naming the option, no traceback, nothing on
stdout, and no ``--out`` folder. ``verify`` with a policy whose arm fails exits 1 ("unsafe"), with a passing
policy 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import traceback
from pathlib import Path

import pytest

from conftest import ROOT
from models import MLP, MLP_BATCH, TROUBLE, TROUBLE_BATCH
from precision_audit.cli import MAX_STEPS, main


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    argv: list[str]            # without --out (added)
    words: tuple[str, ...]     # the first is on the error line


CASES = [
    Case("target-empty", [MLP, "--batch", MLP_BATCH, "--target", ""], ("--target", "GPU name is empty", "targets")),
    Case("target-blank", [MLP, "--batch", MLP_BATCH, "--target", "  "], ("--target", "GPU name is empty")),
    Case("steps-over-the-maximum", [MLP, "--batch", MLP_BATCH, "--steps", str(MAX_STEPS + 1)],
         ("--steps", f"{MAX_STEPS + 1} is more than the maximum, {MAX_STEPS}")),
    Case("steps-astronomical", [MLP, "--batch", MLP_BATCH, "--steps", "9" * 30], ("--steps", "more than the maximum")),
    Case("budget-key-twice", [MLP, "--batch", MLP_BATCH, "--budget", "loss=0.01,loss=0.5"],
         ("--budget gives loss twice", "give loss=VALUE once")),
    Case("budget-key-twice-spaced", [MLP, "--batch", MLP_BATCH, "--budget", "output=0.1, loss=0.2 ,output =0.3"],
         ("--budget gives output twice",)),
    Case("budget-nan", [MLP, "--batch", MLP_BATCH, "--budget", "loss=nan"], ("--budget", "positive finite")),
    Case("budget-infinite", [MLP, "--batch", MLP_BATCH, "--budget", "output=1e999"], ("--budget", "positive finite")),
    Case("verify-steps-over-the-maximum", ["verify", MLP, "--batch", MLP_BATCH, "--policy", "policy.json",
                                           "--steps", str(MAX_STEPS + 1)], ("--steps", f"from 1 to {MAX_STEPS}")),
    Case("verify-steps-zero", ["verify", MLP, "--batch", MLP_BATCH, "--policy", "policy.json", "--steps", "0"],
         ("--steps", "from 1 to")),
    Case("export-to-empty", ["export", "policy.json", "--to", ""], ("--to", "invalid choice: ''")),
    Case("verify-seed-too-large", ["verify", MLP, "--batch", MLP_BATCH, "--policy", "policy.json",
                                   "--seed", str(2 ** 64)], ("--seed", "outside the range", "2**64 - 1")),
    Case("verify-seed-too-small", ["verify", MLP, "--batch", MLP_BATCH, "--policy", "policy.json",
                                   "--seed", str(-(2 ** 63) - 1)], ("--seed", "outside the range")),
]


def run(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    err, out = io.StringIO(), io.StringIO()
    before = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse: usage and one error line, exit 2
                code = e.code if isinstance(e.code, int) else 1
            except Exception:  # what the console script would show
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(before)
    return code, err.getvalue(), out.getvalue()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_option_exits_2_naming_it(tmp_path, case: Case):
    out_dir = tmp_path / "out"
    argv = case.argv + (["--out", str(out_dir)] if case.argv[0] != "export" else [])
    code, err, out = run(argv + (["-q"] if case.argv[0] != "export" else []), tmp_path)
    assert "Traceback" not in err, err
    assert code == 2, f"exit {code}; stderr:\n{err}"
    error_lines = [line for line in err.splitlines() if re.match(r"precision-audit( [a-z-]+)?: error: ", line)]
    assert len(error_lines) == 1, err
    assert case.words[0] in error_lines[0], err
    for w in case.words[1:]:
        assert w in err, f"{w!r} missing from:\n{err}"
    assert out == ""
    assert not out_dir.exists(), "a refused command creates no --out folder"


def test_steps_at_the_maximum_is_accepted_by_the_parser():
    from precision_audit.cli import _audit_parser

    assert _audit_parser().parse_args(["m.py", "--steps", str(MAX_STEPS)]).steps == MAX_STEPS
    # no --steps: resolved per mode by the audit (1 on a GPU, 0 emulated; audit.resolve_steps)
    assert _audit_parser().parse_args(["m.py"]).steps is None


def test_budget_key_once_each_still_works():
    from precision_audit.cli import _budget

    b = _budget("loss=0.02, output=0.1")
    assert (b.max_loss_rel_change, b.max_output_rel_error) == (0.02, 0.1)


def _policy(tmp_path: Path, default: str) -> str:
    import sys

    from precision_audit.policy import LossScaling, Policy, fingerprint, model_layout, save_policy

    sys.path.insert(0, str(ROOT / "sample_models" / "fp16_trouble"))
    try:
        import model as trouble
    finally:
        sys.path.pop(0)
    m = trouble.build_model()
    fp, n = fingerprint(m)
    p = Policy(model_class=type(m).__name__, model_fingerprint=fp, model_modules=n, target_name="H100 SXM",
               target_compute_capability=(9, 0), default_format=default, model_layout=model_layout(m),
               loss_scaling=LossScaling(enabled=default == "fp16", init_scale=65536.0))
    path = tmp_path / f"policy-{default}.json"
    save_policy(p, path)
    return str(path)


def test_verify_exits_1_when_the_policy_arm_fails_and_0_when_it_trains(tmp_path):
    """fp16_trouble's 'hot' module overflows FP16 in the forward pass: an all-fp16 policy cannot train (its loss
    is inf at every step: exit 1, "unsafe"); an all-bf16 policy trains (exit 0). Without the check both exit 0."""
    results = {}
    for default in ("fp16", "bf16"):
        out = tmp_path / f"out-{default}"
        code, err, stdout = run(["verify", TROUBLE, "--batch", TROUBLE_BATCH, "--policy", _policy(tmp_path, default),
                                 "--steps", "3", "--device", "cpu", "--out", str(out), "-q"], tmp_path)
        assert "Traceback" not in err, err
        results[default] = (code, stdout, json.loads((out / "verify.json").read_text()))
    code, stdout, doc = results["fp16"]
    assert code == 1, stdout
    assert doc["policy_safe"] is False and "final loss is not finite (3 of 3" in doc["policy_failure"]
    assert "unsafe: the policy arm's final loss is not finite" in stdout
    code, stdout, doc = results["bf16"]
    assert code == 0, stdout
    assert doc["policy_safe"] is True and doc["policy_failure"] is None
    assert "unsafe" not in stdout


def test_catalogue_ids_are_unique():
    """These cases count toward the bad-input catalogue (tests/cli/test_bad_inputs.py); ids must not repeat."""
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 10


@pytest.mark.parametrize("target", ["", "   "], ids=["empty", "blank"])
def test_the_python_api_refuses_an_empty_target_too(target):
    """AuditOptions(target="") must not silently mean the default target, as the CLI's --target "" doesn't."""
    from precision_audit.audit import AuditOptions
    from precision_audit.errors import OptionError

    with pytest.raises(OptionError, match="target is empty"):
        AuditOptions(model=MLP, target=target)
    assert AuditOptions(model=MLP, target="h100").target == "h100"
