"""The FP16 loss scale comes from the gradients computed in FP16, never from the loss's own dL/dL = 1.

Hand-made models with known gradients give a known ceiling: the largest gradient g admits scales 2^k with
g * 2^k < 65504 (FP16's largest finite value), and the recommendation keeps one doubling of headroom. A tiny
Hugging Face GPT-2 (``output.loss``) is checked against gradients collected independently with hooks.
"""

from __future__ import annotations

import math
import os
import textwrap
from types import SimpleNamespace

import pytest
import torch

from precision_audit.analysis.loss_scale import fp16_gradients, recommend_fp16_loss_scale
from precision_audit.audit import AuditOptions, compute_audit
from precision_audit.formats import Format
from precision_audit.planning.rules import LayerPlan

# A model computing its own loss, returned as ``output.loss`` next to the logits (a hand-made ModelOutput).
# dL/d(small's output) = 2^-5 everywhere and dL/d(small.weight) = 2^-5 * x = 2^-5 (x = 1); "big" (when
# present) gets dL/dy = dL/dW = 8. The loss is an FP32 scalar whose own gradient is 1.
MODEL = textwrap.dedent("""
    from dataclasses import dataclass
    import torch

    @dataclass
    class Output:
        loss: torch.Tensor
        logits: torch.Tensor

    class Net(torch.nn.Module):
        def __init__(self, with_big):
            super().__init__()
            self.small = torch.nn.Linear(4, 4, bias=False)
            self.big = torch.nn.Linear(4, 4, bias=False) if with_big else None
            self.after = torch.nn.Linear(4, 4, bias=False) if with_big == "feeds" else None
            for lin in (self.small, self.big, self.after):
                if lin is not None:
                    torch.nn.init.constant_(lin.weight, 0.25)
            self.register_buffer("c_small", torch.full((1, 4), 2.0 ** -5))
            self.register_buffer("c_big", torch.full((1, 4), 8.0))

        def forward(self, x):
            y = self.small(x)
            loss = (y * self.c_small).sum()
            if self.big is not None:
                z = self.big(x)
                if self.after is not None:   # big's output feeds an FP16 module: dL/dz is computed in FP16
                    z = self.after(z)
                loss = loss + (z * self.c_big).sum()
            return Output(loss=loss, logits=y)

    def build_model():
        return Net({with_big!r})

    def sample_batch():
        return torch.ones(1, 4)
""")


def _audit(tmp_path, with_big=None):
    path = tmp_path / f"net_{with_big}.py"
    path.write_text(MODEL.replace("{with_big!r}", repr(with_big)))
    return compute_audit(AuditOptions(model=str(path), out=tmp_path / "out", steps=0, target="h100",
                                      formats=(Format.FP16, Format.BF16)))


def _ceiling(g: float) -> int:
    """Largest k with g * 2^k below FP16's overflow threshold (brute force over the exponents)."""
    return max(k for k in range(-24, 49) if g * 2.0 ** k < 65504)


def test_loss_gradient_is_left_out_and_the_known_largest_gradient_sets_the_scale(tmp_path):
    c = _audit(tmp_path)
    ls = c.audit["loss_scale"]
    assert ls["max_abs_grad"] == 2.0 ** -5, "dL/dL = 1 must not be the largest gradient"
    assert _ceiling(2.0 ** -5) == 20
    assert ls["max_no_overflow_scale"] == 2.0 ** 20
    assert ls["recommended_init_scale"] == 2.0 ** 19
    if c.policy.loss_scaling.enabled:  # the policy's scale is the plan's
        assert c.policy.loss_scaling.init_scale == ls["plan"]["recommended_init_scale"]
    assert ls["gradients"]["loss_gradient_excluded"] == 1.0
    assert "'small'" in ls["gradients"]["largest_in"]
    assert "loss's own gradient (1, FP32) left out" in ls["reason"]
    # the FP16 pass ran at that scale, and its gradients stayed finite
    assert c.audit["summary"]["fp16"]["loss_scale"] == 2.0 ** 19
    assert c.audit["summary"]["fp16"]["nonfinite"]["param_grads"] == 0


def test_with_the_loss_gradient_counted_the_old_answer_would_be_2_to_14(tmp_path):
    """The defect this replaces: the root's output gradient 1.0 capped every model at 2^15 (init 16384)."""
    c = _audit(tmp_path)
    root = next(r for r in c.capture.layers if r.name == "")
    assert root.grad_loss.amax == 1.0 and root.grad_output.amax == 1.0
    assert _ceiling(1.0) - 1 == 14 and c.audit["loss_scale"]["recommended_init_scale"] != 2.0 ** 14


def test_modules_the_plan_keeps_out_of_fp16_do_not_constrain_it(tmp_path):
    c = _audit(tmp_path, with_big=True)
    layers = c.capture.layers
    uniform = recommend_fp16_loss_scale(layers)
    assert uniform.max_abs_grad == 8.0  # big's output and weight gradients, all in FP16 in the uniform pass
    assert uniform.recommended_exponent == _ceiling(8.0) - 1 == 11
    plan = SimpleNamespace(default_format=Format.FP16,
                           layers={"big": LayerPlan(Format.FP32, "kept in fp32")})
    planned = uniform.for_plan(plan)
    assert planned.max_abs_grad == 2.0 ** -5 and planned.recommended_exponent == 19
    assert planned.uniform is uniform and planned.gradients.modules_not_fp16 == 1
    d = uniform.to_dict(plan)  # audit.json's loss_scale: the uniform pass's, and the plan's inside it
    assert d["recommended_init_scale"] == 2.0 ** 11 and d["plan"]["recommended_init_scale"] == 2.0 ** 19
    assert d["gradients"]["basis"] == "uniform fp16" and d["plan"]["gradients"]["basis"] == "plan"
    # big in BF16 does not constrain the FP16 scale either
    bf16 = uniform.for_plan(SimpleNamespace(default_format=Format.FP16, layers={"big": LayerPlan(Format.BF16, "")}))
    assert bf16.recommended_exponent == 19
    # a plan with nothing in FP16 leaves the uniform finding (the policy turns loss scaling off then)
    assert uniform.for_plan(SimpleNamespace(default_format=Format.BF16, layers={})) is uniform


def test_an_fp32_module_feeding_an_fp16_module_still_constrains_it(tmp_path):
    """Autocast casts the FP32 output to FP16 for the FP16 consumer, whose backward computes dL/dz in FP16."""
    c = _audit(tmp_path, with_big="feeds")
    layers = c.capture.layers
    big = next(r for r in layers if r.name == "big")
    assert big.output_consumers == {0: {"after"}}
    keep_big = fp16_gradients(layers, {"", "small", "after"})
    # dL/d(big's output) = 8 * 0.25 * 4 = 8 reaches FP16 through 'after'; big's weight gradient does not count
    assert keep_big.histogram.amax == 8.0 and keep_big.largest_in == "'big' output gradient"
    both_out = fp16_gradients(layers, {"", "small"})
    assert both_out.histogram.amax == 2.0 ** -5


def test_parameter_gradients_of_modules_without_a_gemm_are_fp32():
    """An embedding's and a norm's weight gradients are FP32 under autocast: they do not constrain the scale."""
    from precision_audit.capture import CaptureConfig, CaptureSession

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.norm = torch.nn.LayerNorm(4)
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, ids):
            return self.fc(self.norm(self.emb(ids)))

    torch.manual_seed(0)
    ids = torch.zeros(64, dtype=torch.long)  # every row looks up token 0: its embedding gradient adds up
    with CaptureSession(Net(), lambda m: m(ids), lambda y: (y * 10).sum(), CaptureConfig((Format.FP16,))) as s:
        s.reference_run()
        rec = {r.name: r for r in s.layers.values()}
    grads = fp16_gradients(rec.values())
    assert rec["emb"].grad_param.amax > grads.histogram.amax or rec["norm"].grad_param.amax > grads.histogram.amax
    assert grads.parameter_modules == 1  # fc only
    assert grads.histogram.amax >= rec["fc"].grad_param.amax


# --- a Hugging Face model whose loss is output.loss ------------------------------------------------------

GPT2_PY = textwrap.dedent("""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    CONFIG = dict(vocab_size=257, n_layer=2, n_embd=32, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    def build_model():
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(**CONFIG))

    def sample_batch():
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 257, (2, 8), generator=g)
        return {"input_ids": ids, "labels": ids}
""")


def _reference_fp16_amax(model, batch) -> float:
    """Independently: the largest |gradient| of every module output except the loss, and of the parameters of
    modules that run a GEMM with them (Linear, GPT-2's Conv1D; the LM head's tied weight included)."""
    seen: list[float] = []
    hooks = []

    def fwd(mod, args, out):
        tensors = [out] if isinstance(out, torch.Tensor) else [v for v in (out.values() if hasattr(out, "values")
                                                                            else out) if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t.is_floating_point() and t.requires_grad and t.numel() > 1:
                t.register_hook(lambda g: seen.append(float(g.abs().max())))

    for m in model.modules():
        hooks.append(m.register_forward_hook(fwd))
    out = model(**batch)
    out.loss.backward()
    for h in hooks:
        h.remove()
    # weights and biases: addmm casts both to FP16, so both gradients are computed in FP16
    gemm_params = [p for m in model.modules() if type(m).__name__ in ("Linear", "Conv1D") for p in m.parameters()]
    return max(seen + [float(p.grad.abs().max()) for p in gemm_params])


def test_gpt2_loss_scale_is_not_capped_by_dl_dl(tmp_path):
    pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = tmp_path / "gpt2_tiny.py"
    path.write_text(GPT2_PY)
    c = compute_audit(AuditOptions(model=str(path), out=tmp_path / "out", steps=0, target="h100",
                                   formats=(Format.FP16,)))
    ls = c.audit["loss_scale"]
    assert c.audit["loss"]["kind"] == "output.loss"
    assert ls["gradients"]["loss_gradient_excluded"] == 1.0
    ns: dict = {}
    exec(GPT2_PY, ns)
    model = ns["build_model"]()
    model.train()
    expected = _reference_fp16_amax(model, ns["sample_batch"]())
    assert ls["max_abs_grad"] != 1.0
    assert math.isclose(ls["max_abs_grad"], expected, rel_tol=1e-5), (ls["max_abs_grad"], expected)
    k = _ceiling(expected)
    assert ls["max_no_overflow_scale"] == 2.0 ** k and ls["recommended_init_scale"] == 2.0 ** (k - 1)
    if c.policy.loss_scaling.enabled:
        assert c.policy.loss_scaling.init_scale == ls["plan"]["recommended_init_scale"]
    else:
        assert ls["plan"] is None


def test_the_policy_takes_the_scale_of_the_plan(tmp_path):
    """policy.json's loss_scaling.init_scale is re-derived for the plan: 'big' in FP32 leaves 2^19, not 2^11."""
    from precision_audit.audit import _policy
    from precision_audit.gpus import resolve_target
    from precision_audit.model_names import fingerprint
    from precision_audit.planning.rules import Plan

    c = _audit(tmp_path, with_big=True)
    keep = LayerPlan(Format.FP32, "kept in fp32")
    plan = Plan(default_format=Format.FP16, default_reason="test", layers={"big": keep}, overrides={"big": keep})
    fp, n = fingerprint(c.model)
    policy = _policy(c.model, fp, n, resolve_target("h100"), plan, c.analysis)
    assert policy.loss_scaling.enabled and policy.loss_scaling.init_scale == 2.0 ** 19
    everything = Plan(default_format=Format.FP16, default_reason="test")
    assert _policy(c.model, fp, n, resolve_target("h100"), everything, c.analysis).loss_scaling.init_scale == 2.0 ** 11


def test_loss_scale_with_its_plan_validates_against_the_schema(tmp_path):
    import json

    from precision_audit.record.codec import clean
    from precision_audit.record.schemas import validate_audit

    c = _audit(tmp_path, with_big=True)
    doc = json.loads(json.dumps(c.audit))
    plan = SimpleNamespace(default_format=Format.FP16, layers={"big": LayerPlan(Format.FP32, "kept in fp32")})
    doc["loss_scale"] = clean(c.analysis.loss_scale.to_dict(plan))
    validate_audit(doc)
    assert doc["loss_scale"]["plan"]["gradients"]["modules_not_fp16"] == 1
    # the terminal and the report show both: the uniform pass's scale and the plan's
    from precision_audit.record.codec import from_json
    from precision_audit.report.html import render_html
    from precision_audit.report.terminal import summary_text

    text = summary_text(doc)
    assert "fp16 loss scale: 2^11 (2,048)" in text and "for the plan: 2^19 (524,288)" in text, text
    section = render_html(from_json(doc), c.policy.to_dict()).split('id="loss-scale"')[1].split("</section>")[0]
    assert "For the plan" in section and "left out" in section and "&#39;big&#39; output gradient" in section
