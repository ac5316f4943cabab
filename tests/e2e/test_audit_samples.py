"""End-to-end audits of the bundled sample models: what the audit finds, and what it leaves untouched."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

from conftest import ROOT, SAMPLES, layer
from precision_audit.audit import AuditOptions, run_audit


@pytest.mark.parametrize("name", SAMPLES)
def test_every_sample_audits_quickly_and_writes_three_files(sample_audits, name):
    result, out, elapsed = sample_audits.get(name)
    assert result.exit_code == 0, result.audit["verdict"]
    assert elapsed < 60, f"{name} took {elapsed:.1f}s; the acceptance bound is 60 s on 2 cores"
    for f in ("audit.json", "policy.json", "report.html"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0
    a = json.loads((out / "audit.json").read_text())
    assert a["mode"] == "emulated" and a["formats"] == ["fp16", "bf16"]
    assert {L["name"] for L in a["layers"]} >= {""}, "the whole model has a row"
    assert all(L["calls"] >= 1 for L in a["layers"])
    assert not list(out.glob(".*.tmp")), "no temporary file left behind"


def test_fp16_trouble_overflowing_block_is_reported_in_fp16_not_bf16(sample_audits):
    a = sample_audits.audit_json("fp16_trouble")
    hot = layer(a, "hot")
    assert hot["activation"]["amax"] > 65504
    assert hot["activation"]["fractions"]["fp16"]["overflow"] > 0.1
    assert hot["activation"]["fractions"]["bf16"]["overflow"] == 0
    assert hot["activation"]["headroom_bits"]["fp16"] < 0 < hot["activation"]["headroom_bits"]["bf16"]
    assert hot["error"]["fp16"]["local"]["nonfinite"] > 0, "the fp16 re-run of hot overflows to inf"
    assert hot["error"]["bf16"]["local"]["nonfinite"] == 0
    assert not a["summary"]["fp16"]["safe"] and a["summary"]["bf16"]["safe"]
    assert a["loss_scale"]["viable"] is False and "hot" in a["loss_scale"]["reason"]


def test_fp16_trouble_underflowing_branch_is_fixed_by_the_recommended_scale(sample_audits):
    a = sample_audits.audit_json("fp16_trouble")
    ls = a["loss_scale"]
    assert ls["recommended_init_scale"] > 1
    lo, hi = ls["safe_range"]
    assert lo <= ls["recommended_init_scale"] <= hi
    for name in ("faint", "faint.0", "faint.2"):
        g = layer(a, name)["gradient"]["output"]["fp16"]
        assert g["unscaled"]["flushed"] > 0.5, f"{name}: gradients should flush to zero at scale 1"
        assert g["at_recommended"]["flushed"] < 0.01, f"{name}: the recommended scale should lift them"
    for name in ("faint.0", "faint.2"):
        p = layer(a, name)["gradient"]["parameters"]["fp16"]
        assert p["unscaled"]["flushed"] > 0.1 and p["at_recommended"]["flushed"] < 0.01
    # and no gradient overflows at the recommended scale
    assert all(((L["gradient"]["output"]["fp16"]["at_recommended"] or {}).get("overflow", 0) == 0) for L in a["layers"])


def test_v100_target_keeps_the_overflowing_block_out_of_fp16(sample_audits):
    result, out, _ = sample_audits.get("fp16_trouble", target="v100")
    a = json.loads((out / "audit.json").read_text())
    policy = json.loads((out / "policy.json").read_text())
    assert a["formats"] == ["fp16"] and a["formats_skipped"][0]["format"] == "bf16"
    # the mixed plan (fp16, 'hot' in fp32) is weighed; this 4k-parameter model is launch-bound, every kernel at the
    # cost model's per-kernel floor (docs/report.md, "The cost model's floor") but the head's FP32 GEMMs: on a V100's
    # CUDA cores at the calibrated share of its 15.7 TFLOP/s (docs/gpu.md) they take longer, so the mixed plan is
    # estimated faster than fp32 and returned; 'hot' stays out of fp16 either way
    mixed = next(c for c in a["plan"]["candidates"] if c["label"] == "mixed")
    fp32 = next(c for c in a["plan"]["candidates"] if c["label"] == "uniform fp32")
    assert mixed["default_format"] == "fp16" and mixed["overrides"] == 1 and mixed["chosen"]
    assert mixed["estimated_step_time_s"] < fp32["estimated_step_time_s"]
    assert policy["default_format"] == "fp16" and policy["modules"]["hot"]["format"] == "fp32"
    assert result.exit_code == 1, "fp16 alone is unsafe as is, and it is the only candidate on a V100"


def test_default_target_without_gpu_is_h100_and_says_so(sample_audits):
    a = sample_audits.audit_json("mlp")
    assert a["target"]["key"] == "h100-sxm" and "default" in a["target"]["reason"]
    policy = json.loads((sample_audits.get("mlp")[1] / "policy.json").read_text())
    assert policy["default_format"] == "bf16" and policy["modules"] == {}


def test_loss_kinds_are_reported(sample_audits):
    assert sample_audits.audit_json("tiny_gpt")["loss"]["kind"] == "loss_fn"
    assert sample_audits.audit_json("mlp")["loss"]["kind"] == "cross_entropy"
    a = sample_audits.audit_json("fp16_trouble")
    assert a["loss"]["kind"] == "mse" and any("loss inferred" in w for w in a["warnings"])


def test_module_called_twice_is_one_row_with_two_calls(tmp_path):
    (tmp_path / "twice.py").write_text(textwrap.dedent("""
        import torch
        class Twice(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.shared = torch.nn.Linear(16, 16)
                self.scale = torch.nn.Parameter(torch.full((16,), 0.5))
            def forward(self, x):
                return self.shared(self.shared(x)) * self.scale
        def build_model():
            torch.manual_seed(0)
            return Twice()
        def sample_batch():
            return torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    """))
    r = run_audit(AuditOptions(model=str(tmp_path / "twice.py"), out=tmp_path / "out", steps=0))
    shared = layer(r.audit, "shared")
    assert shared["calls"] == 2
    root = layer(r.audit, "")
    assert root["computes"], "x * scale inside the root's own forward is computation of its own"
    assert r.audit["loss"]["kind"] == "surrogate"


PLANTED = textwrap.dedent('''
    import importlib.util, sys, torch
    spec = importlib.util.spec_from_file_location("tiny_gpt_base", {path!r})
    base = importlib.util.module_from_spec(spec); spec.loader.exec_module(base)

    class CoarseUnderAutocast(torch.nn.Linear):
        """A Linear whose weights are rounded to 2 mantissa bits whenever autocast is on: extra error that
        enters only in low precision, and only here."""
        def forward(self, x):
            w = self.weight
            if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
                m, e = torch.frexp(w.float())
                w = torch.ldexp(torch.round(m * 8) / 8, e)
            return torch.nn.functional.linear(x, w, self.bias)

    def build_model():
        model = base.build_model()
        old = model.blocks[0].mlp.c_fc
        new = CoarseUnderAutocast(old.in_features, old.out_features, bias=old.bias is not None)
        new.load_state_dict(old.state_dict())
        model.blocks[0].mlp.c_fc = new
        return model

    loss_fn = base.loss_fn
''')


def test_planted_error_has_the_largest_local_error_and_later_layers_only_inherit_it(tmp_path):
    path = ROOT / "sample_models" / "tiny_gpt" / "model.py"
    (tmp_path / "planted.py").write_text(PLANTED.format(path=str(path)))
    r = run_audit(AuditOptions(model=str(tmp_path / "planted.py"), batch=str(path.parent / "sample.pt"),
                               out=tmp_path / "out", steps=0))
    a = r.audit
    planted = "blocks.0.mlp.c_fc"
    leaves = [L for L in a["layers"] if L["is_leaf"] and L["error"]["bf16"]["local"] is not None]
    for fmt in ("bf16", "fp16"):
        worst = max(leaves, key=lambda L: L["error"][fmt]["local"]["rel_l2"])
        assert worst["name"] == planted, f"{fmt}: largest local error at {worst['name']}, not the planted layer"
        planted_local = layer(a, planted)["error"][fmt]["local"]["rel_l2"]
        order = [L["name"] for L in a["layers"]]
        after = [L for L in leaves if order.index(L["name"]) > order.index(planted)]
        assert after, "there are layers after the planted one"
        for L in after:
            assert L["error"][fmt]["local"]["rel_l2"] < planted_local / 5, \
                f"{L['name']} should not add error of its own comparable to the planted layer"
        # the error is inherited downstream: accumulated error after the planted layer exceeds local error
        lm = layer(a, "lm_head")["error"][fmt]
        assert lm["accumulated"]["rel_l2"] > 3 * lm["local"]["rel_l2"]
    # the planner ranks it first: with a budget tighter than its impact it is the first module held back
    from precision_audit.analysis.findings import Budget

    tight = run_audit(AuditOptions(model=str(tmp_path / "planted.py"), batch=str(path.parent / "sample.pt"),
                                   out=tmp_path / "out2", steps=0, budget=Budget(max_loss_rel_change=1e-5))).audit
    assert tight["plan"]["overrides"][planted]["format"] == "fp32", tight["plan"]["overrides"]
    pinned = [n for n, o in tight["plan"]["overrides"].items() if o["format"] == "fp32"]
    assert pinned == [planted], f"only the planted layer needs fp32 (others get cheaper fixes): {pinned}"


USER_PKG = textwrap.dedent("""
    import torch
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(8)
            self.drop = torch.nn.Dropout(0.3)
            self.head = torch.nn.Linear(8 * 8 * 8, 10)
            self.frozen = torch.nn.Linear(10, 10)
            self.frozen.requires_grad_(False)
        def forward(self, x):
            h = self.drop(torch.relu(self.bn(self.conv(x))))
            return self.frozen(self.head(h.flatten(1)))
    torch.manual_seed(0)
    MODEL = Net()
    BATCH = (torch.randn(4, 3, 8, 8), torch.tensor([1, 2, 3, 4]))
    def sample_batch():
        return BATCH
""")


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_users_model_and_global_state_are_unchanged(tmp_path, monkeypatch, training):
    name = f"user_model_pkg_{int(training)}"
    (tmp_path / f"{name}.py").write_text(USER_PKG)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    mod = importlib.import_module(name)
    model = mod.MODEL.train(training)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    old_prec = torch.get_float32_matmul_precision()
    r = run_audit(AuditOptions(model=f"{name}:MODEL", out=tmp_path / "out", steps=1))
    assert r.audit["model"]["training"] is training
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} changed (BatchNorm running stats must not move)"
    assert model.training is training
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng), "the global RNG state must be restored"
    assert not torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert torch.get_float32_matmul_precision() == old_prec
    assert not torch.backends.cuda.matmul.allow_tf32
    # CPU autocast's own policy is back (the CUDA-policy registrations are gone)
    with torch.autocast("cpu", dtype=torch.float16):
        y = torch.nn.functional.layer_norm(torch.randn(2, 4).half(), (4,))
    assert y.dtype == torch.float16
    sys.modules.pop(name, None)


def test_same_seed_gives_identical_numbers(tmp_path):
    path = ROOT / "sample_models" / "cnn"
    docs = []
    for i in range(2):
        r = run_audit(AuditOptions(model=str(path / "model.py"), batch=str(path / "sample.pt"),
                                   out=tmp_path / f"o{i}", steps=0))
        d = r.audit
        docs.append(json.dumps({"layers": d["layers"], "loss_scale": d["loss_scale"],
                                "summary": {k: {kk: vv for kk, vv in v.items() if kk != "step_time"}
                                            for k, v in d["summary"].items()}}, sort_keys=True))
    assert docs[0] == docs[1]
