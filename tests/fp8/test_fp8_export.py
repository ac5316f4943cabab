"""`export --to torchao` and `--to torchtitan` (precision_audit/fp8/export.py): the generated torchao code converts
exactly the policy's FP8 modules; torchtitan's TOML keeps the rest in filter_fqns; hostile module names reach
either output only escaped."""

from __future__ import annotations

import ast

import pytest
import tomllib
import torch
import torch.nn as nn

from precision_audit.cli.export import export_main
from precision_audit.export import EXPORT_TARGETS, export_policy
from precision_audit.policy import LossScaling, Policy, fingerprint, model_layout
from precision_audit.policy.io import dumps_policy

HOSTILE = 'x"\n]\nimport os #\x7f\u00e9\U0001F600\\'


class Net(nn.Module):
    def __init__(self, names=("a", "b", "c")):
        super().__init__()
        for n in names:
            self.add_module(n, nn.Linear(32, 32))

    def forward(self, x):
        for m in self.children():
            x = m(x)
        return x


def _policy(model, fp8):
    fp, n = fingerprint(model)
    return Policy(model_class="Net", model_fingerprint=fp, model_modules=n, target_name="H100 SXM",
                  target_compute_capability=(9, 0), default_format="bf16", modules={}, loss_scaling=LossScaling(),
                  model_layout=model_layout(model),
                  extra={"fp8": {"modules": {k: {"recipe": v, "reason": "r"} for k, v in fp8.items()}}})


def test_targets_listed():
    assert "torchao" in EXPORT_TARGETS and "torchtitan" in EXPORT_TARGETS


def test_torchao_code_converts_exactly_the_planned_modules():
    pytest.importorskip("torchao", reason="torchao is not installed (pip install '.[fp8]')")
    model = Net()
    out = export_policy(_policy(model, {"a": "fp8_rowwise", "b": "fp8_tensorwise", "c": "mxfp8"}), "torchao")
    assert out.suffix == ".py" and any("'c'" in n and "mxfp8" in n for n in out.notes)
    ns: dict = {}
    exec(compile(out.text, "fp8_torchao.py", "exec"), ns)
    assert ns["FP8_MODULES"] == {"a": "rowwise", "b": "tensorwise"}
    ns["apply_fp8"](model, emulate=True)
    assert [type(m).__name__ for m in model.children()] == ["Float8Linear", "Float8Linear", "Linear"]
    assert model.a.config.round_scales_to_power_of_2 and not model.b.config.round_scales_to_power_of_2
    assert torch.isfinite(model(torch.randn(4, 32))).all()


def test_torchtitan_toml():
    model = Net(("a", "b", "c", "d"))
    out = export_policy(_policy(model, {"a": "fp8_rowwise", "b": "fp8_rowwise", "c": "fp8_tensorwise"}), "torchtitan")
    cfg = tomllib.loads(out.text)
    assert cfg["model"]["converters"] == ["float8"]
    assert cfg["float8"]["recipe_name"] == "rowwise"
    assert cfg["float8"]["filter_fqns"] == ["c", "d"]  # c is planned under another recipe, d not in FP8
    assert any("one recipe" in n for n in out.notes)


def test_hostile_names_stay_data(tmp_path, capsys):
    model = Net(("a", HOSTILE))
    pol = _policy(model, {HOSTILE: "fp8_tensorwise"})
    py = export_policy(pol, "torchao").text
    tree = ast.parse(py)
    assigns = [n for n in tree.body if isinstance(n, ast.Assign)]
    assert ast.literal_eval(assigns[0].value) == {HOSTILE: "tensorwise"}
    assert sum(isinstance(n, (ast.Import, ast.ImportFrom)) for n in tree.body) == 2  # nothing added
    toml = tomllib.loads(export_policy(pol, "torchtitan").text)
    assert toml["float8"]["filter_fqns"] == ["a"] and toml["float8"]["recipe_name"] == "tensorwise"
    path = tmp_path / "policy.json"
    path.write_text(dumps_policy(pol), encoding="utf-8")
    for to in ("torchao", "torchtitan"):
        assert export_main([str(path), "--to", to, "--out", str(tmp_path / f"out.{to}")]) == 0


def test_policy_without_fp8_modules_says_so():
    model = Net()
    fp, n = fingerprint(model)
    v1 = Policy(model_class="Net", model_fingerprint=fp, model_modules=n, target_name="H100 SXM",
                target_compute_capability=(9, 0), default_format="bf16", modules={}, loss_scaling=LossScaling())
    for to in ("torchao", "torchtitan"):
        out = export_policy(v1, to)
        assert any("no FP8 modules" in n for n in out.notes)
    assert tomllib.loads(export_policy(v1, "torchtitan").text)["model"]["converters"] == []
