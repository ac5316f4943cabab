"""FP8 modules under autocast (docs/fp8.md, "Runtime"; precision_audit/fp8/autocast_safe.py). torchao 0.18's
Float8Linear with a recipe that keeps a GEMM in high precision (``rowwise_with_gw_hp``) fails in the backward under
autocast; apply_fp8 and the exported code make those modules (and only those) autocast-safe: they train under
autocast close to the FP32 model, are torchao's module bit for bit outside autocast, deep-copy and pickle."""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from precision_audit.policy import LossScaling, Policy, fingerprint, model_layout

torchao = pytest.importorskip("torchao", reason="torchao is not installed (pip install '.[fp8]')")

from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from precision_audit.fp8.apply import apply_fp8  # noqa: E402

#: Relative L2 error allowed against the FP32 model: E4M3 keeps 3 mantissa bits, so rounding an operand costs a
#: relative error uniform within +-2^-4 of each value's magnitude, RMS about 0.026; a GEMM of two such operands
#: about 0.036, a gradient through two FP8 GEMMs about 0.05 (measured here: 0.034-0.055 over seeds 0-4). 2^-3, one
#: E4M3 step, is over twice that, and far below what a wrong result gives (a lost scale, a transposed gradient: O(1)).
FP8_REL = 2.0 ** -3
#: ... and at least this much: the FP8 modules' weight gradients differ from FP32 by more than BF16 alone would
#: (BF16 rounding, 8 mantissa bits: about 1e-3), so FP8 did run.
FP8_MIN = 1e-2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 64)
        self.head = nn.Linear(64, 16)

    def forward(self, x):
        return self.head(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 64, generator=g), torch.randn(32, 16, generator=g)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _train(model, x, y, steps, autocast=True):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_a_gw_hp_module_trains_under_autocast_close_to_fp32():
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    assert apply_fp8(model, {"fc1": "fp8_rowwise_gw_hp", "fc2": "fp8_rowwise_gw_hp"}, emulate=True) == ["fc1", "fc2"]
    x, y = _batch()
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == torch.bfloat16  # the autocast dtype, as torchao returns under autocast
    loss = F.mse_loss(out.float(), y)
    loss.backward()  # torchao 0.18 alone: "expected m1 and m2 to have the same dtype" (BFloat16 != float)
    assert abs(float(loss.detach()) - float(ref_loss.detach())) / float(ref_loss.detach()) < FP8_REL
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and _rel(p.grad, q.grad) < FP8_REL, name
    assert _rel(model.fc1.weight.grad, ref.fc1.weight.grad) > FP8_MIN
    assert _rel(model.fc2.weight.grad, ref.fc2.weight.grad) > FP8_MIN
    losses = _train(model, x, y, 10)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def _plain_torchao(model, names, recipe="rowwise_with_gw_hp"):
    cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn in names, config=cfg)
    return model


def test_outside_autocast_the_swapped_module_is_torchaos_bit_for_bit():
    from precision_audit.fp8.autocast_safe import AutocastSafeFloat8Linear

    torch.manual_seed(0)
    base = Net()
    ours, theirs = copy.deepcopy(base), _plain_torchao(copy.deepcopy(base), {"fc1", "fc2"})
    apply_fp8(ours, {"fc1": "fp8_rowwise_gw_hp", "fc2": "fp8_rowwise_gw_hp"}, emulate=True)
    assert type(ours.fc1) is AutocastSafeFloat8Linear and type(theirs.fc1) is Float8Linear
    x, y = _batch()
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    outs = [m(xi) for m, xi in zip((ours, theirs), xs)]
    assert torch.equal(outs[0], outs[1])
    for o in outs:
        F.mse_loss(o, y).backward()
    assert torch.equal(xs[0].grad, xs[1].grad)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_under_an_autocast_torchao_reads_the_module_is_torchaos(monkeypatch):
    """torchao 0.18 casts its input itself under CUDA's autocast only: there every high-precision pair agrees and
    the swapped module defers to torchao, so that on a GPU the weight-gradient GEMM stays BF16 (as fp8/cost.py
    prices it). Shown on the CPU by declaring its autocast one torchao reads: the forward is then torchao's, bit
    for bit; left as shipped, the rule applies and the output differs."""
    from precision_audit.fp8 import autocast_safe

    assert autocast_safe.TORCHAO_READS_AUTOCAST == {"cuda"}
    torch.manual_seed(0)
    base = Net()
    ours, theirs = copy.deepcopy(base), _plain_torchao(copy.deepcopy(base), {"fc1", "fc2"})
    apply_fp8(ours, {"fc1": "fp8_rowwise_gw_hp", "fc2": "fp8_rowwise_gw_hp"}, emulate=True)
    x, _ = _batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        theirs_out = theirs(x)
        ruled = ours(x)
        monkeypatch.setattr(autocast_safe, "TORCHAO_READS_AUTOCAST", frozenset({"cuda", "cpu"}))
        deferred = ours(x)
    assert torch.equal(deferred, theirs_out)
    assert not torch.equal(ruled, theirs_out)


@pytest.mark.parametrize("recipe", ["rowwise_with_gw_hp", "rowwise", "tensorwise"])
def test_under_autocast_the_module_is_the_documented_rule_written_out(recipe):
    """docs/fp8.md, "Runtime": torchao's module with autocast off on the input rounded to the autocast dtype and held
    as FP32, its output rounded to the autocast dtype. gw_hp through apply_fp8, the others through the swap verify
    gives every converted module in emulated mode (its behaviour before the class: the same rule as a wrapper)."""
    from precision_audit.fp8.autocast_safe import make_autocast_safe

    torch.manual_seed(0)
    base = Net()
    ours, theirs = _plain_torchao(copy.deepcopy(base), {"fc1"}, recipe), _plain_torchao(copy.deepcopy(base), {"fc1"},
                                                                                       recipe)
    assert make_autocast_safe(ours, ["fc1"]) == ["fc1"]
    x, y = _batch()
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ours.fc1(xs[0])
        with torch.autocast("cpu", enabled=False):
            want = theirs.fc1(xs[1].to(torch.bfloat16).float()).to(torch.bfloat16)
    assert out.dtype == want.dtype == torch.bfloat16 and torch.equal(out, want)
    for o in (out, want):
        F.mse_loss(o.float(), y.repeat(1, 4)).backward()
    assert torch.equal(xs[0].grad, xs[1].grad)
    assert torch.equal(ours.fc1.weight.grad, theirs.fc1.weight.grad)
    assert torch.equal(ours.fc1.bias.grad, theirs.fc1.bias.grad)


def test_only_recipes_that_keep_a_gemm_in_high_precision_are_swapped():
    from torchao.float8.config import CastConfig, ScalingType

    from precision_audit.fp8.autocast_safe import AutocastSafeFloat8Linear, keeps_a_gemm_in_high_precision

    model = Net()
    apply_fp8(model, {"fc1": "fp8_tensorwise", "fc2": "fp8_rowwise", "head": "fp8_rowwise_gw_hp"}, emulate=True)
    assert {n: type(m) for n, m in model.named_children()} == {
        "fc1": Float8Linear, "fc2": Float8Linear, "head": AutocastSafeFloat8Linear}
    # decided from the config: torchao's recipes, and a hand-made config with a DISABLED pair
    assert {r: keeps_a_gemm_in_high_precision(Float8LinearConfig.from_recipe_name(r))
            for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp")} == {
        "tensorwise": False, "rowwise": False, "rowwise_with_gw_hp": True}
    def off():
        return CastConfig(scaling_type=ScalingType.DISABLED)
    assert keeps_a_gemm_in_high_precision(Float8LinearConfig(cast_config_input_for_grad_weight=off(),
                                                             cast_config_grad_output_for_grad_weight=off()))
    # tensorwise and rowwise train under autocast as torchao has them
    x, y = _batch()
    losses = _train(model, x, y, 5)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_the_converted_model_deep_copies_and_pickles_and_the_copies_train():
    torch.manual_seed(0)
    model = Net()
    apply_fp8(model, {"fc1": "fp8_rowwise_gw_hp", "fc2": "fp8_tensorwise"}, emulate=True)
    x, y = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copies = [copy.deepcopy(model), torch.load(buf, weights_only=False), pickle.loads(pickle.dumps(model))]
    assert "AutocastSafeFloat8Linear" in repr(model) and "cast_configs=" in repr(model.fc1)
    for c in copies:
        assert type(c.fc1) is type(model.fc1) and c.fc1.weight is not model.fc1.weight
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(c(x), want)
        with torch.no_grad():
            c.fc1.weight.zero_()  # the copy computes with its own weights (an instance forward would not)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not torch.equal(c(x), want)
        losses = _train(c, x, y, 5)
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(x), want)  # the original untouched


def test_the_exported_torchao_code_trains_a_gw_hp_module_under_autocast_as_the_runtime_does():
    from precision_audit.export import export_policy

    torch.manual_seed(0)
    base = Net()
    fp, n = fingerprint(base)
    plan = {"fc1": "fp8_rowwise_gw_hp", "fc2": "fp8_tensorwise"}
    pol = Policy(model_class="Net", model_fingerprint=fp, model_modules=n, target_name="H100 SXM",
                 target_compute_capability=(9, 0), default_format="bf16", modules={}, loss_scaling=LossScaling(),
                 model_layout=model_layout(base),
                 extra={"fp8": {"modules": {k: {"recipe": r, "reason": "r"} for k, r in plan.items()}}})
    ns: dict = {}
    exec(compile(export_policy(pol, "torchao").text, "fp8_torchao.py", "exec"), ns)
    exported, runtime = copy.deepcopy(base), copy.deepcopy(base)
    ns["apply_fp8"](exported, emulate=True)
    apply_fp8(runtime, plan, emulate=True)
    assert [type(m).__name__ for m in exported.children()] == ["AutocastSafeFloat8Linear", "Float8Linear", "Linear"]
    x, y = _batch()
    losses = _train(exported, x, y, 10)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert losses == _train(runtime, x, y, 10)  # the generated code is the runtime's


def test_verify_trains_a_gw_hp_module_under_emulated_autocast():
    from precision_audit.verify import VerifyOptions, run_verify

    torch.manual_seed(0)
    model = Net()
    x, y = _batch()
    fp, n = fingerprint(model)
    pol = Policy(model_class="Net", model_fingerprint=fp, model_modules=n, target_name="H100 SXM",
                 target_compute_capability=(9, 0), default_format="bf16", modules={}, loss_scaling=LossScaling(),
                 model_layout=model_layout(model),
                 extra={"fp8": {"modules": {"fc1": {"recipe": "fp8_rowwise_gw_hp", "reason": "r"},
                                            "fc2": {"recipe": "fp8_tensorwise", "reason": "r"}}}})
    r = run_verify(model, lambda m: m(x), lambda o: F.mse_loss(o.float(), y), pol, "cpu", "emulated",
                   VerifyOptions(steps=5, lr=1e-2))
    assert r.policy_safe and not r.errors
    assert all(v is not None for v in r.curves["policy_fp8"])
    assert r.curves["policy_fp8"] != r.curves["policy"]
    assert r.final_loss_rel_change["policy_fp8"] < FP8_REL
    assert type(model.fc1) is nn.Linear
