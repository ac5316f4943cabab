"""The bad-input catalogue: every user mistake exits 2 with one message naming the problem and the fix.

Each case builds its files in a fresh folder and runs ``precision_audit.cli.main`` in-process (policy cases
call the policy API, which is what a CLI command reading a policy runs). For every case:

- the exit code is 2 (argparse's own errors included: they exit 2 through ``SystemExit``);
- stderr holds the message, with the case's key words, and no traceback; stdout is empty;
- ``--out`` is left alone: it does not exist afterwards, or, when it held a good previous audit, it holds the
  same bytes, and no ``.tmp`` file is left anywhere.

A second test checks that the message is *one* message: one ``error:`` line, at most one ``fix:``, and a user
error is not presented as something "the model raised". Ctrl-C runs in a subprocess (exit 130).

Cases marked ``xfail(strict=True)`` would be known bugs outside this file's reach (none open today).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import ROOT
from models import HEADER, LINEAR, MLP, MLP_BATCH, model_file
from precision_audit.cli import main
from precision_audit.errors import AuditError

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0




class Point:
    """A custom class pickled into a batch: torch.load(weights_only=True) must refuse it."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


# ---------------------------------------------------------------------------------------------------------------
# building the inputs of a case
# ---------------------------------------------------------------------------------------------------------------


def batch_file(d: Path, obj: Any, name: str = "batch.pt") -> str:
    p = d / name
    torch.save(obj, p)
    return str(p)


def x8(d: Path) -> str:
    return batch_file(d, torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), "x8.pt")


def linear_with(forward: str, extra: str = "") -> str:
    """A model file whose nn.Linear(8, 4) output goes through ``forward`` (an expression in ``y`` and ``x``)."""
    return HEADER + extra + textwrap.dedent(f"""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            y = self.fc(x)
            return {forward}

    def build_model():
        torch.manual_seed(0)
        return M()
    """)


def raising_on_call(n: int, error: str) -> str:
    """A model whose root forward raises ``error`` on its n-th call (1: the FP32 reference; 2: the fp16 pass)."""
    return HEADER + textwrap.dedent(f"""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls == {n}:
                raise {error}
            return self.fc(x)

    def build_model():
        return M()
    """)


BACKWARD_RAISES = HEADER + """
class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("the custom kernel has no backward for this input")

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return Boom.apply(self.fc(x))

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return self.block(x)

def build_model():
    return M()
"""

BACKWARD_OOM = BACKWARD_RAISES.replace(
    'raise RuntimeError("the custom kernel has no backward for this input")',
    'raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")')

DEEP_RAISE = HEADER + """
class Picky(nn.Module):
    def forward(self, x):
        if (x < 0).any():
            raise ValueError("Picky expects non-negative inputs")
        return x

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(8, 8), Picky(), nn.Linear(8, 4))

    def forward(self, x):
        return self.blocks(x)

def build_model():
    torch.manual_seed(0)
    return M()
"""

POLICY_TEXT_BROKEN = '{\n  "schema": "precision-audit/policy"\n  "version": 1\n}\n'


def good_policy_dict() -> dict:
    """A valid policy for the MLP sample (the one the good audit writes)."""
    from precision_audit.loading import load_model
    from precision_audit.policy.schema import LossScaling, Policy, fingerprint

    model, _ = load_model(MLP)
    fp, n = fingerprint(model)
    return Policy(model_class=type(model).__name__, model_fingerprint=fp, model_modules=n, target_name="H100 SXM",
                  target_compute_capability=(9, 0), target_key="h100-sxm", default_format="bf16", modules={},
                  loss_scaling=LossScaling(enabled=False, init_scale=65536.0), tf32_matmul=True, tf32_cudnn=True,
                  tool_version="0").to_dict()


def raw_file(d: Path, content: str | bytes, name: str = "file.bin") -> str:
    p = d / name
    p.write_bytes(content.encode() if isinstance(content, str) else content)
    return str(p)


def policy_file(d: Path, content: str | bytes) -> str:
    return raw_file(d, content, "policy.json")


def load_policy_call(path: str) -> Callable[[], Any]:
    from precision_audit.policy.io import load_policy

    return lambda: load_policy(path)


def check_trainable_call(path: str) -> Callable[[], Any]:
    """What the audit runs right after loading the model (loading.check_trainable)."""
    from precision_audit.loading import check_trainable, load_model

    return lambda: check_trainable(*load_model(path))


def policy_for_another_model(d: Path) -> Callable[[], Any]:
    from precision_audit.policy.schema import Policy

    policy = Policy.from_dict(good_policy_dict())
    other = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    return lambda: policy.check_model(other)


def claim_cuda(mp: pytest.MonkeyPatch) -> None:
    """Make the audit believe a GPU is present (to reach the --emulate/--device cuda check on any machine)."""
    import precision_audit.options as options_module  # set_up's (precision_audit/options.py)

    real = options_module.detect
    mp.setattr(options_module, "detect", lambda: dataclasses.replace(real(), cuda_available=True))


def unwritable_dir(d: Path) -> str:
    p = d / "readonly"
    p.mkdir()
    p.chmod(0o500)
    return str(p / "out")


# ---------------------------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input. ``build(d)`` writes the case's files into ``d`` and returns the CLI arguments (``--out``
    is added unless given) or a callable to run instead (policy API cases)."""

    id: str
    build: Callable[[Path], list[str] | Callable[[], Any]]
    words: tuple[str, ...]
    code: int = 2
    prev_good: bool = False          # --out holds a good previous audit that must survive byte for byte
    patch: Callable[[pytest.MonkeyPatch], None] | None = None
    bug: str | None = None           # known bug: the contract test fails today
    message_bug: str | None = None   # known bug: the one-message test fails today
    skip: str | None = None


def _cuda_skip() -> str | None:
    return "this machine has CUDA" if torch.cuda.is_available() else None


CASES: list[Case] = [
    # --- MODEL -------------------------------------------------------------------------------------------------
    Case("missing-model-file", lambda d: [str(d / "nope.py"), "--batch", x8(d)],
         ("model file not found", "nope.py", "check the path")),
    Case("model-is-a-directory", lambda d: [str(Path(model_file(d / "pkg", LINEAR)).parent), "--batch", x8(d)],
         ("is a directory", "model.py")),
    Case("model-not-a-py-file", lambda d: [batch_file(d, torch.ones(2), "model.pt"), "--batch", x8(d)],
         ("not a .py file", "--batch")),
    Case("syntax-error", lambda d: [model_file(d, HEADER + "def build_model(:\n    return nn.Linear(8, 4)\n"),
                                    "--batch", x8(d)],
         ("syntax error in model.py", "line 3")),
    Case("raises-at-import", lambda d: [model_file(d, HEADER + "SIZE = int('eight')\n"), "--batch", x8(d)],
         ("importing model.py raised ValueError", "model.py, line 3", "SIZE = int('eight')")),
    Case("missing-import", lambda d: [model_file(d, "import no_such_package_xyz\n"), "--batch", x8(d)],
         ("ModuleNotFoundError", "no_such_package_xyz", "model.py, line 1")),
    Case("sys-exit-at-import", lambda d: [model_file(d, "raise SystemExit('needs --config')\n"), "--batch", x8(d)],
         ("importing model.py raised SystemExit", "needs --config")),
    Case("no-model-found", lambda d: [model_file(d, HEADER + "def helper():\n    return 1\n"), "--batch", x8(d)],
         ("no model found in model.py", "build_model, get_model, model", "helper")),
    Case("unknown-attribute", lambda d: [model_file(d, LINEAR) + ":build_modle", "--batch", x8(d)],
         ("'build_modle' not found", "did you mean 'build_model'")),
    Case("unknown-package-module", lambda d: ["no_such_pkg_xyz.models:factory", "--batch", x8(d)],
         ("cannot import module 'no_such_pkg_xyz.models'", "pip install")),
    Case("factory-needs-arguments",
         lambda d: [model_file(d, HEADER + "def build_model(width, depth=2):\n    return nn.Linear(width, 4)\n"),
                    "--batch", x8(d)],
         ("needs arguments", "width", "build_model")),
    Case("not-a-module", lambda d: [model_file(d, "model = {'weights': [1, 2]}\n"), "--batch", x8(d)],
         ("'model' in model.py is not a model", "nn.Module")),
    Case("factory-returns-none", lambda d: [model_file(d, HEADER + "def build_model():\n    nn.Linear(8, 4)\n"),
                                            "--batch", x8(d)],
         ("did not return an nn.Module", "NoneType", "return the model")),
    Case("factory-raises",
         lambda d: [model_file(d, HEADER + "def build_model():\n    return nn.Linear(8, -4)\n"), "--batch", x8(d)],
         ("calling build_model() from model.py raised", "model.py, line 4", "nn.Linear(8, -4)")),
    Case("no-parameters",
         lambda d: [model_file(d, HEADER + "def build_model():\n    return nn.ReLU()\n"), "--batch", x8(d)],
         ("no parameters", "ReLU"), prev_good=True),
    Case("all-parameters-frozen",
         lambda d: [model_file(d, HEADER + "def build_model():\n    return nn.Linear(8, 4).requires_grad_(False)\n"),
                    "--batch", x8(d)],
         ("requires grad", "requires_grad_(True)")),
    Case("low-precision-parameters-only",
         lambda d: [model_file(d, HEADER + "def build_model():\n    return nn.Linear(8, 4).to(torch.bfloat16)\n"),
                    "--batch", x8(d)],
         ("trains bfloat16 parameters only", "2 trained parameter tensors, all bfloat16",
          "build the model in float32")),
    Case("float64-parameters-only",
         lambda d: [model_file(d, HEADER + "def build_model():\n    return nn.Linear(8, 4).double()\n"),
                    "--batch", x8(d)],
         ("trains float64 parameters and no float32 ones", "autocast leaves float64 tensors in float64",
          "2 trained parameter tensors, all float64", "drop the .double()")),
    Case("no-parameters-load-check",
         lambda d: check_trainable_call(model_file(d, HEADER + "def build_model():\n    return nn.ReLU()\n")),
         ("has no parameters", "ReLU", "pass the model that owns the weights")),
    Case("all-parameters-frozen-load-check",
         lambda d: check_trainable_call(model_file(d, HEADER + "model = nn.Linear(8, 4).requires_grad_(False)\n")),
         ("none of the parameters", "2 parameter tensors (36 values), all frozen", "requires_grad_(True)")),
    # --- BATCH -------------------------------------------------------------------------------------------------
    Case("missing-batch-file", lambda d: [model_file(d, LINEAR), "--batch", str(d / "nope.pt")],
         ("batch file not found", "nope.pt")),
    Case("batch-is-a-directory", lambda d: [model_file(d, LINEAR), "--batch", str(d)],
         ("--batch is a directory",)),
    Case("no-batch-and-no-sample-batch", lambda d: [model_file(d, LINEAR)],
         ("--batch is required", "sample_batch()", "torch.save")),
    Case("sample-batch-raises",
         lambda d: [model_file(d, LINEAR + "def sample_batch():\n    raise OSError('data/ not mounted')\n")],
         ("sample_batch() in model.py raised OSError", "data/ not mounted", "model.py, line")),
    Case("batch-is-text", lambda d: [model_file(d, LINEAR), "--batch", raw_file(d, "1,2,3\n", "batch.csv")],
         ("not a torch.save file", "a text file", "torch.save(batch")),
    Case("batch-is-empty-file", lambda d: [model_file(d, LINEAR), "--batch", raw_file(d, b"", "batch.pt")],
         ("not a torch.save file", "an empty file")),
    Case("batch-is-binary-junk",
         lambda d: [model_file(d, LINEAR), "--batch", raw_file(d, b"\x80\x02junk\x00\xff\xfe" * 20, "batch.pt")],
         ("not a torch.save file", "binary data")),
    Case("batch-truncated-zip",
         lambda d: [model_file(d, LINEAR), "--batch", raw_file(d, Path(MLP_BATCH).read_bytes()[:300], "batch.pt")],
         ("not a torch.save file", "truncated or corrupted")),
    Case("batch-pickled-custom-object",
         lambda d: [model_file(d, LINEAR), "--batch", batch_file(d, Point(torch.ones(4, 8)))],
         ("Point", "weights_only=True", "never unpickles", "re-save the batch", "torch.save((x, y)")),
    Case("batch-numpy-array",
         lambda d: [model_file(d, LINEAR), "--batch", batch_file(d, (__import__("numpy").zeros((4, 8), "float32"),))],
         ("numpy", "torch.from_numpy", "never unpickles")),
    Case("batch-shape-rejected", lambda d: [MLP, "--batch", batch_file(d, (torch.randn(4, 3), torch.zeros(4).long()))],
         ("mat1 and mat2 shapes cannot be multiplied", "in module 'fc1'"), prev_good=True),
    Case("batch-empty-tensor", lambda d: [model_file(d, LINEAR), "--batch", batch_file(d, torch.empty(0, 8))],
         ("is empty", "[0, 8]")),
    Case("batch-empty-tuple", lambda d: [model_file(d, LINEAR), "--batch", batch_file(d, ())],
         ("is empty", "an empty tuple")),
    Case("batch-empty-dict", lambda d: [model_file(d, LINEAR), "--batch", batch_file(d, {})],
         ("is empty", "an empty dict")),
    Case("batch-with-nan",
         lambda d: [model_file(d, LINEAR), "--batch", batch_file(d, torch.tensor([[float("nan")] * 8] * 2))],
         ("non-finite", "16 NaN", "without NaN/Inf")),
    Case("batch-with-inf",
         lambda d: [model_file(d, LINEAR), "--batch", batch_file(d, torch.full((2, 8), float("inf")))],
         ("non-finite", "16 Inf")),
    Case("batch-holds-no-tensor", lambda d: [model_file(d, LINEAR), "--batch", batch_file(d, [1, 2])],
         ("holds no tensor", "torch.tensor(")),
    Case("batch-is-a-string", lambda d: [model_file(d, LINEAR), "--batch", batch_file(d, "hello")],
         ("holds no tensor", "a str")),
    Case("batch-keys-forward-does-not-take",
         lambda d: [model_file(d, LINEAR), "--batch",
                    batch_file(d, {"inputs": torch.ones(4, 8), "mask": torch.ones(4)})],
         ("does not take: inputs, mask", "valid choices: input")),
    Case("batch-too-many-positional-inputs",
         lambda d: [model_file(d, LINEAR), "--batch", batch_file(d, (torch.ones(4, 8),) * 4)],
         ("takes 1 positional input", "holds 4 elements")),
    # --- RUNNING THE MODEL -------------------------------------------------------------------------------------
    Case("model-raises-in-a-submodule", lambda d: [model_file(d, DEEP_RAISE), "--batch", x8(d)],
         ("ValueError", "Picky expects non-negative inputs", "in module 'blocks.1'"), prev_good=True),
    Case("output-has-no-floating-tensor",
         lambda d: [model_file(d, linear_with("y.argmax(-1)")), "--batch", x8(d)],
         ("no floating-point tensor", "loss_fn(output, batch)"), prev_good=True),
    Case("fp32-reference-times-inf", lambda d: [model_file(d, linear_with("y * float('inf')")), "--batch", x8(d)],
         ("FP32 reference is already not finite", "non-finite"), prev_good=True),
    Case("fp32-reference-log-of-zero",
         lambda d: [model_file(d, linear_with("y + torch.log(torch.zeros(4))")), "--batch", x8(d)],
         ("FP32 reference is already not finite", "log of 0")),
    Case("loss-fn-raises",
         lambda d: [model_file(d, LINEAR + "def loss_fn(output, batch):\n    return output.logits.mean()\n"),
                    "--batch", x8(d)],
         ("loss_fn(output, batch) in model.py raised", "model.py, line")),
    Case("loss-fn-returns-a-vector",
         lambda d: [model_file(d, LINEAR + "def loss_fn(output, batch):\n    return output.sum(0)\n"),
                    "--batch", x8(d)],
         ("did not return a scalar", "shape [4]", ".mean()")),
    Case("loss-fn-returns-a-float",
         lambda d: [model_file(d, LINEAR + "def loss_fn(output, batch):\n    return output.sum().item()\n"),
                    "--batch", x8(d)],
         ("did not return a scalar", "a float", "not loss.item()")),
    Case("loss-without-graph",
         lambda d: [model_file(d, LINEAR + "def loss_fn(output, batch):\n    return output.detach().pow(2).mean()\n"),
                    "--batch", x8(d)],
         ("the loss does not require grad", "without grad_fn", "any .detach()")),
    Case("model-raises-in-backward", lambda d: [model_file(d, BACKWARD_RAISES), "--batch", x8(d)],
         ("FP32 backward pass", "RuntimeError", "the custom kernel has no backward"), prev_good=True),
    Case("gpu-oom-in-fp32-forward",
         lambda d: [model_file(d, raising_on_call(1, 'torch.OutOfMemoryError("CUDA out of memory. Tried to '
                                                     'allocate 20.00 GiB")')), "--batch", x8(d)],
         ("out of memory", "smaller batch", "--device cpu"), prev_good=True),
    Case("gpu-oom-in-fp16-pass",
         lambda d: [model_file(d, raising_on_call(2, 'torch.OutOfMemoryError("CUDA out of memory. Tried to '
                                                     'allocate 20.00 GiB")')), "--batch", x8(d)],
         ("out of memory", "smaller batch", "--device cpu"), prev_good=True),
    Case("gpu-oom-in-backward", lambda d: [model_file(d, BACKWARD_OOM), "--batch", x8(d)],
         ("ran out of memory", "smaller batch", "--device cpu"), prev_good=True),
    # --- OPTIONS -----------------------------------------------------------------------------------------------
    Case("unknown-target", lambda d: [MLP, "--batch", MLP_BATCH, "--target", "h1000"],
         ("unknown target GPU 'h1000'", "h100-sxm", "a100-80gb", "precision-audit targets"), prev_good=True),
    Case("unknown-format", lambda d: [MLP, "--batch", MLP_BATCH, "--formats", "fp16,fp12"],
         ("unknown format 'fp12'", "bf16", "fp8_e4m3")),
    Case("formats-empty-string", lambda d: [MLP, "--batch", MLP_BATCH, "--formats", ""],
         ("--formats is empty", "fp16")),
    Case("formats-only-commas", lambda d: [MLP, "--batch", MLP_BATCH, "--formats", ",,"],
         ("--formats is empty", "fp16, bf16")),
    Case("formats-not-measurable", lambda d: [MLP, "--batch", MLP_BATCH, "--formats", "tf32", "--target", "v100"],
         ("none of the formats asked for can be audited", "no tf32 Tensor Cores", "Ampere", "fp16")),
    Case("format-the-target-lacks", lambda d: [MLP, "--batch", MLP_BATCH, "--formats", "bf16", "--target", "t4"],
         ("none of the formats asked for", "T4", "no bf16 Tensor Cores", "pick another --target")),
    Case("steps-negative", lambda d: [MLP, "--batch", MLP_BATCH, "--steps", "-1"],
         ("--steps must be a whole number >= 0", "-1")),
    Case("steps-not-a-number", lambda d: [MLP, "--batch", MLP_BATCH, "--steps", "two"],
         ("argument --steps", "invalid int value: 'two'")),
    Case("seed-not-a-number", lambda d: [MLP, "--batch", MLP_BATCH, "--seed", "x"],
         ("argument --seed", "invalid int value")),
    Case("budget-garbage", lambda d: [MLP, "--batch", MLP_BATCH, "--budget", "garbage"],
         ("cannot read --budget 'garbage'", "loss=0.01", "loss, output")),
    Case("budget-not-a-number", lambda d: [MLP, "--batch", MLP_BATCH, "--budget", "loss=abc"],
         ("--budget loss must be a number", "'abc'")),
    Case("budget-negative", lambda d: [MLP, "--batch", MLP_BATCH, "--budget", "loss=-1"],
         ("--budget", "positive")),
    Case("device-unknown", lambda d: [MLP, "--batch", MLP_BATCH, "--device", "gpu"],
         ("argument --device", "invalid choice: 'gpu'", "'cpu'")),
    Case("device-cuda-without-cuda", lambda d: [MLP, "--batch", MLP_BATCH, "--device", "cuda"],
         ("--device cuda", "no CUDA GPU", "--device cpu"), skip=_cuda_skip()),
    Case("emulate-with-device-cuda", lambda d: [MLP, "--batch", MLP_BATCH, "--device", "cuda", "--emulate"],
         ("--emulate", "cannot be combined with --device cuda"), patch=claim_cuda),
    # --- --out ---------------------------------------------------------------------------------------------------
    Case("out-is-a-file", lambda d: [MLP, "--batch", MLP_BATCH, "--out", raw_file(d, "keep me\n", "afile")],
         ("is a file, not a folder", "pass another --out")),
    Case("out-inside-a-file",
         lambda d: [MLP, "--batch", MLP_BATCH, "--out", str(Path(raw_file(d, "keep me\n", "afile")) / "sub")],
         ("is a file, so no folder can be made inside it",)),
    Case("out-not-writable", lambda d: [MLP, "--batch", MLP_BATCH, "--out", unwritable_dir(d)],
         ("not writable", "--out"), skip="root writes into a 0o500 folder anyway" if IS_ROOT else None),
    Case("out-under-proc", lambda d: [MLP, "--batch", MLP_BATCH, "--out", "/proc/precision-audit-test-out"],
         ("/proc/precision-audit-test-out", "not writable", "--out"),
         skip=None if Path("/proc").is_dir() else "no /proc here"),
    Case("out-audit-json-is-a-folder", lambda d: [MLP, "--batch", MLP_BATCH, "--steps", "0"],
         ("folder named audit.json", "--out"), prev_good=True),
    # --- POLICY FILES ------------------------------------------------------------------------------------------
    Case("policy-malformed-json", lambda d: load_policy_call(policy_file(d, POLICY_TEXT_BROKEN)),
         ("not valid JSON", "line 3, column 3", "fix the JSON syntax")),
    Case("policy-unknown-version",
         lambda d: load_policy_call(policy_file(d, json.dumps({**good_policy_dict(), "version": 99}))),
         ("'version' is 99", "upgrade precision-audit")),
    Case("policy-for-another-model", policy_for_another_model,
         ("made for another model", "MLP", "re-run precision-audit")),
    Case("policy-missing-file", lambda d: load_policy_call(str(d / "nope.json")),
         ("no policy file", "nope.json")),
    Case("policy-not-utf8", lambda d: load_policy_call(policy_file(d, b'{"schema": "\xff"}')),
         ("not UTF-8",)),
    Case("policy-not-an-object", lambda d: load_policy_call(policy_file(d, "[1, 2]")),
         ("must be a JSON object", "array")),
    Case("policy-nan", lambda d: load_policy_call(policy_file(d, json.dumps(good_policy_dict()).replace(
        '"init_scale": 65536.0', '"init_scale": NaN'))), ("NaN", "finite number")),
    Case("policy-duplicate-key",
         lambda d: load_policy_call(policy_file(d, '{"schema": "precision-audit/policy", "schema": "x"}')),
         ("'schema' twice",)),
]


def _params(check: str) -> list[Any]:
    out = []
    for c in CASES:
        marks = []
        reason = c.message_bug if check == "message" else c.bug
        if c.skip:
            marks.append(pytest.mark.skip(reason=c.skip))
        elif reason:
            marks.append(pytest.mark.xfail(strict=True, reason=reason))
        out.append(pytest.param(c, id=c.id, marks=marks))
    return out


def test_catalogue_has_30_cases_with_unique_ids():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    assert len([c for c in CASES if not c.bug]) >= 30, "the issue asks for at least 30 passing cases"


# ---------------------------------------------------------------------------------------------------------------
# running a case
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    code: int
    err: str
    out: str
    out_dir: Path
    before: dict[str, bytes] | None  # the good previous audit's files, or None when --out did not exist


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def good_audit(tmp_path_factory) -> Path:
    """One good audit of the MLP sample: the 'previous audit' a failed run must leave untouched."""
    out = tmp_path_factory.mktemp("good") / "audit"
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        assert main([MLP, "--batch", MLP_BATCH, "--out", str(out), "-q", "--steps", "0"]) == 0
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, good_audit) -> Callable[[Case], Outcome]:
    """Runs each case once (both tests below read its outcome)."""
    cache: dict[str, Outcome] = {}

    def run(case: Case) -> Outcome:
        if case.id not in cache:
            cache[case.id] = _run(case, tmp_path_factory.mktemp(case.id), good_audit)
        return cache[case.id]

    return run


def _run(case: Case, d: Path, good_audit: Path) -> Outcome:
    out_dir = d / "out"
    before = None
    if case.prev_good:
        shutil.copytree(good_audit, out_dir)
        if case.id == "out-audit-json-is-a-folder":
            (out_dir / "audit.json").unlink()
            (out_dir / "audit.json").mkdir()
        before = _snapshot(out_dir)
    err, out = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(d)  # relative paths in messages stay inside the case folder
    try:
        with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            if case.patch:
                case.patch(mp)
            action = case.build(d)
            if callable(action):  # a policy API case: what a CLI command reading a policy prints
                try:
                    action()
                    code = 0
                except AuditError as e:
                    print(f"precision-audit: error: {e.message}", file=sys.stderr)
                    code = e.exit_code
            else:
                argv = list(action)
                if "--out" not in argv:
                    argv += ["--out", str(out_dir)]
                if "--steps" not in argv:
                    argv += ["--steps", "0"]
                try:
                    code = main(argv + ["--quiet"])
                except SystemExit as e:  # argparse: usage and one error line, exit 2
                    code = e.code if isinstance(e.code, int) else 1
                except Exception:  # what the console script would show: a traceback, exit 1
                    traceback.print_exc(file=sys.stderr)
                    code = 1
    finally:
        os.chdir(cwd)
        for p in d.rglob("*"):  # let pytest clean up the 0o500 folder
            if p.is_dir():
                with contextlib.suppress(OSError):
                    p.chmod(0o755)
    return Outcome(code, err.getvalue(), out.getvalue(), out_dir, before)


@pytest.mark.parametrize("case", _params("contract"))
def test_bad_input_exits_2_with_a_message_and_leaves_out_alone(outcomes, case: Case):
    o = outcomes(case)
    assert "Traceback" not in o.err, o.err
    assert o.code == case.code, f"exit code {o.code}; stderr:\n{o.err}"
    for word in case.words:
        assert word in o.err, f"{word!r} missing from the message:\n{o.err}"
    assert o.out == "", f"nothing on stdout for a failed audit, got:\n{o.out}"
    if o.before is not None:
        assert _snapshot(o.out_dir) == o.before, "the previous good audit in --out was changed"
    else:
        assert not o.out_dir.exists(), "a failed audit creates no --out folder"
    leftovers = list(o.out_dir.parent.rglob("*.tmp"))
    assert not leftovers, f"temporary files left behind: {leftovers}"


@pytest.mark.parametrize("case", _params("message"))
def test_bad_input_message_is_one_message(outcomes, case: Case):
    o = outcomes(case)
    lines = o.err.rstrip("\n").splitlines()
    errors = [L for L in lines if L.startswith("precision-audit: error:")]
    assert len(errors) == 1, f"one error line expected:\n{o.err}"
    assert sum(L.lstrip().startswith("fix:") for L in lines) <= 1, f"more than one fix:\n{o.err}"
    wrapped = re.search(r"raised (AuditError|ModelLoadError|BatchError|LossError|OptionError|ModelRunError|"
                        r"NumericsError|PolicyError|OutputError)\b", o.err)
    assert wrapped is None, f"a user error is presented as raised by the model:\n{o.err}"
    if not errors[0].startswith("precision-audit: error: argument"):  # argparse's own line comes with usage
        assert lines[0] == errors[0], f"the message starts with the error line:\n{o.err}"


# ---------------------------------------------------------------------------------------------------------------
# a forward that changes its output structure between calls
# ---------------------------------------------------------------------------------------------------------------

# call 1 is the FP32 reference, call 2 the fp16 pass, call 3 the bf16 pass
CHANGING = {
    "tensor-then-dict": "y if self.calls == 1 else {'out': y, 'extra': y * 2}",
    "extra-output-on-even-calls": "y if self.calls % 2 else (y, y[:, :3])",
}


@pytest.mark.parametrize("forward", list(CHANGING.values()), ids=list(CHANGING))
def test_forward_changing_structure_is_refused(tmp_path, capsys, forward):
    """Outputs of another structure cannot be compared with the reference: the audit stops (it used to warn,
    then judge the mismatched pass 'unsafe' from a surrogate loss over other tensors)."""
    out = tmp_path / "out"
    code = main([model_file(tmp_path, linear_with(forward)), "--batch", x8(tmp_path), "--out", str(out),
                 "-q", "--steps", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "different output structures" in err and "Tensor[4,4]" in err and ("dict(" in err or "tuple(" in err)
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------------------
# Ctrl-C (a real SIGINT, in a subprocess)
# ---------------------------------------------------------------------------------------------------------------

SIGINT_ON_SECOND_CALL = HEADER + """
import os, signal

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 2:  # the fp16 pass, after the FP32 reference
            os.kill(os.getpid(), signal.SIGINT)
        return self.fc(x)

def build_model():
    torch.manual_seed(0)
    return M()
"""


def _cli(args: list[str], cwd: Path, code: str = "") -> subprocess.CompletedProcess:
    prog = ("import sys\n" + code + "\nfrom precision_audit.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", prog, *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


def test_ctrl_c_during_a_run_exits_130_and_keeps_the_previous_audit(tmp_path, good_audit):
    out = tmp_path / "out"
    shutil.copytree(good_audit, out)
    before = _snapshot(out)
    p = _cli([model_file(tmp_path, SIGINT_ON_SECOND_CALL), "--batch", x8(tmp_path), "--out", str(out), "-q",
              "--steps", "0"], tmp_path)
    assert p.returncode == 130, p.stderr
    assert "interrupted" in p.stderr and "Traceback" not in p.stderr
    assert _snapshot(out) == before, "the previous good audit was changed by an interrupted one"
    assert not list(tmp_path.rglob("*.tmp"))


INTERRUPT_BETWEEN_REPLACES = """
import os, signal
_real_replace, _n = os.replace, [0]
def _replace(src, dst):
    _n[0] += 1
    if _n[0] == 2:  # Ctrl-C lands after the first file of the new audit is in place
        os.kill(os.getpid(), signal.SIGINT)
    return _real_replace(src, dst)
os.replace = _replace
"""


def test_ctrl_c_while_files_are_moved_into_place_leaves_one_consistent_audit(tmp_path, good_audit):
    out = tmp_path / "out"
    shutil.copytree(good_audit, out)
    before = _snapshot(out)
    # another model than the good audit's, so that each of the three files would change
    p = _cli([model_file(tmp_path, LINEAR), "--batch", x8(tmp_path), "--out", str(out), "-q", "--steps", "0"],
             tmp_path, INTERRUPT_BETWEEN_REPLACES)
    assert "Traceback" not in p.stderr
    assert not list(tmp_path.rglob("*.tmp"))
    after = _snapshot(out)
    changed = {k for k in before if after.get(k) != before[k]}
    assert changed in (set(), set(before)), (  # every old file replaced (the old TensorBoard events removed) or none
        f"a mix of the old and the new audit: changed {sorted(changed)}; exit {p.returncode}: {p.stderr}")
    if changed:
        assert "no output file was replaced" not in p.stderr


# ---------------------------------------------------------------------------------------------------------------
# a backward that fails only in low precision
# ---------------------------------------------------------------------------------------------------------------

BACKWARD_FP32_ONLY = HEADER + """
class Fp32Only(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        if g.dtype != torch.float32:
            raise RuntimeError(f"fused kernel supports float32 gradients only, got {g.dtype}")
        return g * 2.0

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return Fp32Only.apply(self.fc(x))

def build_model():
    torch.manual_seed(0)
    return M()
"""


def test_backward_failing_only_in_low_precision_is_reported_not_a_traceback(tmp_path, capsys):
    out = tmp_path / "out"
    code = main([model_file(tmp_path, BACKWARD_FP32_ONLY), "--batch", x8(tmp_path), "--out", str(out), "-q",
                 "--steps", "0"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if code == 2:
        assert "backward" in err and "float32 gradients only" in err
    else:
        warnings = json.loads((out / "audit.json").read_text())["warnings"]
        assert any("fp16 pass not measured" in w and "float32 gradients only" in w for w in warnings), warnings


@pytest.mark.parametrize(("version", "refused"), [("2.6.0+cu124", True), ("2.8.0", True), ("1.13.1", True),
                                                  ("2.9.1+cu128", False), ("2.13.0+cpu", False),
                                                  ("2.14.0a0+gitabc", False), ("3.0.0", False)])
def test_torch_older_than_the_supported_one_is_refused_by_its_version(version, refused):
    from precision_audit.errors import TorchVersionError, check_torch_version

    if not refused:
        check_torch_version(version)
        return
    with pytest.raises(TorchVersionError) as e:
        check_torch_version(version)
    assert f"found:    torch {version}" in e.value.message and "expected: torch >= 2.9" in e.value.message


def test_an_old_torch_gets_one_message_before_anything_runs(tmp_path, capsys, monkeypatch):
    """torch 2.6 ran the audit into AttributeErrors (no fp32_precision TF32 switches, no float8_e8m0fnu, FSDP2
    without gloo); the command line and the package's lazy names now say what is wrong first."""
    import precision_audit
    from precision_audit import errors

    monkeypatch.setattr(errors, "_installed_torch", lambda: "2.6.0+cu124")
    out = tmp_path / "out"
    code = main([str(ROOT / "sample_models" / "mlp" / "model.py"), "--out", str(out), "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and not out.exists()
    assert err.startswith("precision-audit: error: torch 2.6.0+cu124 is older than precision-audit supports")
    assert "fix: pip install 'torch>=2.9'" in err
    with pytest.raises(errors.TorchVersionError):
        precision_audit.__getattr__("apply_policy")
    monkeypatch.setattr(errors, "_installed_torch", lambda: None)
    assert main(["targets"]) == 2 and "torch is not installed" in capsys.readouterr().err
