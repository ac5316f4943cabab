"""`export --to torchao` and `--to torchtitan` (precision_audit/fp8/export.py): the generated torchao code converts
exactly the policy's FP8 modules; the torchtitan 0.3 settings, run through torchao with torchtitan 0.3's module filter,
convert exactly the modules the policy converts and keep the rest in filter_fqns; hostile module names reach either
output only escaped; 100k FP8 modules export in seconds."""

from __future__ import annotations

import ast
import dataclasses
import random
import time

import pytest
import torch
import torch.nn as nn

from precision_audit.cli.export import export_main
from precision_audit.export import EXPORT_TARGETS, export_policy
from precision_audit.fp8.export import TORCHTITAN_RECIPES, substring_clashes
from precision_audit.model_names import layout_fingerprint
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


def _titan(out) -> dict:
    ns: dict = {}
    exec(compile(out.text, "torchtitan_float8.py", "exec"), ns)
    return ns


def _convert_as_torchtitan_0_3(model: nn.Module, float8: dict) -> list[str]:
    """What torchtitan 0.3's Float8LinearConverter does with these fields (its components/quantization/utils.py
    module_filter_fn and float8.py): torchao's config from recipe_name, and a linear converted when both its dims
    are multiples of 16 and no filter_fqns entry is a substring of its name. Returns the converted names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(float8["recipe_name"]), emulate=True)

    def keep_out(mod, fqn):
        return (mod.in_features % 16 == 0 and mod.out_features % 16 == 0
                and not any(f in fqn for f in float8["filter_fqns"]))

    convert_to_float8_training(model, config=config, module_filter_fn=keep_out)
    return sorted(n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear")


def test_torchtitan_settings_convert_the_planned_modules():
    """torchtitan 0.3 takes rowwise / rowwise_with_gw_hp only (no tensorwise): the most used of those is written,
    the modules under another recipe are kept in high precision with a note, and the settings, applied as torchtitan
    0.3 applies them, convert exactly CONVERTED; the converted model's forward is finite."""
    pytest.importorskip("torchao", reason="torchao is not installed (pip install '.[fp8]')")
    model = Net(("a", "b", "c", "d", "e"))
    out = export_policy(_policy(model, {"a": "fp8_rowwise", "b": "fp8_rowwise", "c": "fp8_tensorwise",
                                        "e": "fp8_rowwise_gw_hp"}), "torchtitan")
    assert out.suffix == ".py"
    ns = _titan(out)
    assert ns["FLOAT8"] == {"recipe_name": "rowwise", "filter_fqns": ["c", "d", "e"]}
    assert ns["FLOAT8"]["recipe_name"] in TORCHTITAN_RECIPES and ns["CONVERTED"] == ["a", "b"]
    assert any("no tensorwise recipe" in n for n in out.notes) and any("one recipe" in n for n in out.notes)
    assert _convert_as_torchtitan_0_3(model, ns["FLOAT8"]) == ns["CONVERTED"]
    assert torch.isfinite(model(torch.randn(4, 32))).all()


def test_torchtitan_settings_build_its_converter_config():
    """With torchtitan 0.3 importable (it needs triton, so a CUDA build), float8_converter() builds its Config."""
    pytest.importorskip("torchtitan.components.quantization",
                        reason="torchtitan 0.3 does not import here (it needs triton; pip install torchtitan==0.3.0)")
    model = Net(("a", "b"))
    cfg = _titan(export_policy(_policy(model, {"a": "fp8_rowwise"}), "torchtitan"))["float8_converter"](False)
    assert (cfg.recipe_name, cfg.filter_fqns, cfg.model_compile_enabled) == ("rowwise", ["b"], False)


def test_torchtitan_substring_matches_are_named():
    """A kept "l1" inside a converted "l10" keeps that one too in torchtitan: the note names it."""
    model = Net(("l1", "l10", "l2"))
    out = export_policy(_policy(model, {"l10": "fp8_rowwise", "l2": "fp8_rowwise"}), "torchtitan")
    assert _titan(out)["FLOAT8"]["filter_fqns"] == ["l1"]
    assert any("matches filter_fqns by substring" in n and "'l10'" in n and "'l2'" not in n for n in out.notes)


def test_substring_clashes_equal_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        names = ["".join(rng.choice("ab.1") for _ in range(rng.randint(1, 6))) for _ in range(12)]
        keep, conv = names[:6], [n for n in names[6:] if n not in names[:6]]
        brute = [b for b in conv if any(a in b for a in keep)]
        assert substring_clashes(keep, conv) == brute, (keep, conv)


def test_a_hundred_thousand_fp8_modules_export_in_seconds():
    """The substring check compared every kept name with every converted one: 100k modules took over 60 s."""
    layout = {"": "Net[]", **{f"layers.{i}.wq": "Linear[weight:32x32]" for i in range(100_000)}}
    fp8 = {f"layers.{i}.wq": {"recipe": "fp8_rowwise" if i % 2 else "fp8_tensorwise", "reason": "r"}
           for i in range(100_000)}
    policy = Policy(model_class="Net", model_fingerprint=layout_fingerprint(layout), model_modules=len(layout),
                    target_name="H100 SXM", target_compute_capability=(9, 0), default_format="bf16", modules={},
                    loss_scaling=LossScaling(), model_layout=layout, extra={"fp8": {"modules": fp8}})
    t0 = time.perf_counter()
    out = export_policy(policy, "torchtitan")
    took = time.perf_counter() - t0
    assert took < 30, f"{took:.1f} s"
    ns = _titan(out)
    assert len(ns["CONVERTED"]) == 50_000 and len(ns["FLOAT8"]["filter_fqns"]) == 50_000


def test_hostile_names_stay_data(tmp_path, capsys):
    model = Net(("a", HOSTILE))
    pol = _policy(model, {HOSTILE: "fp8_tensorwise"})
    py = export_policy(pol, "torchao").text
    tree = ast.parse(py)
    assigns = {n.targets[0].id: n.value for n in tree.body if isinstance(n, ast.Assign)}
    assert ast.literal_eval(assigns["FP8_MODULES"]) == {HOSTILE: "tensorwise"}
    imported = sorted(ast.unparse(n) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
    assert imported == ["from torchao.float8 import Float8LinearConfig, convert_to_float8_training",  # nothing added
                        "from torchao.float8.config import CastConfig, ScalingType",
                        "from torchao.float8.float8_linear import Float8Linear", "import dataclasses", "import torch"]
    titan = export_policy(pol, "torchtitan").text
    tree = ast.parse(titan)
    assert sum(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(tree)) == 1  # only torchtitan's
    assert _titan(export_policy(pol, "torchtitan"))["FLOAT8"] == {"recipe_name": None, "filter_fqns": ["a", HOSTILE]}
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
    ns = _titan(export_policy(v1, "torchtitan"))
    assert ns["CONVERTED"] == [] and ns["float8_converter"]() is None
