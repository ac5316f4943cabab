"""`precision-audit verify`: A/B short training under FP32, the policy, plain BF16 and plain FP16."""

from __future__ import annotations

import json

from conftest import ROOT
from precision_audit.cli import main

TROUBLE = ROOT / "sample_models" / "fp16_trouble"


def test_verify_adds_loss_curves_to_the_audit_and_the_report(tmp_path, capsys):
    out = tmp_path / "o"
    args = [str(TROUBLE / "model.py"), "--batch", str(TROUBLE / "sample.pt"), "--out", str(out), "-q"]
    assert main(args + ["--target", "v100", "--steps", "0"]) == 1  # fp16 alone is unsafe on a V100
    assert main(["verify"] + args[:3] + ["--policy", str(out / "policy.json"), "--out", str(out), "--steps", "6",
                                         "-q"]) == 0
    a = json.loads((out / "audit.json").read_text())
    v = a["verify"]
    assert set(v["curves"]) == {"fp32", "policy", "bf16", "fp16"}
    assert all(len(c) == 6 for c in v["curves"].values())
    # the policy keeps 'hot' in fp32, so it trains like fp32; plain fp16 overflows in 'hot' every step
    assert all(x is not None for x in v["curves"]["policy"])
    assert v["final_loss_rel_change"]["policy"] < 1e-2
    assert v["skipped_steps"]["fp16"] == 6 and all(x is None for x in v["curves"]["fp16"])
    html = (out / "report.html").read_text()
    assert 'id="verify"' in html and "policy" in html
    printed = capsys.readouterr().out
    assert "policy" in printed and "fp16" in printed


def test_verify_refuses_a_policy_for_another_model(tmp_path, capsys):
    out = tmp_path / "o"
    mlp = ROOT / "sample_models" / "mlp"
    assert main([str(mlp / "model.py"), "--batch", str(mlp / "sample.pt"), "--out", str(out), "-q",
                 "--steps", "0"]) == 0
    code = main(["verify", str(TROUBLE / "model.py"), "--batch", str(TROUBLE / "sample.pt"),
                 "--policy", str(out / "policy.json"), "--out", str(tmp_path / "v"), "--steps", "2", "-q"])
    assert code == 2
    assert "another model" in capsys.readouterr().err


def test_verify_runs_the_models_own_cuda_autocast_code_as_the_audit_does():
    """The emulated arms see the model's ``torch.autocast("cuda", enabled=False)`` regions and its questions about
    CUDA autocast as a GPU answers them: the same curves as the model written for the tensors' own device, which
    PyTorch handles itself. Before, the "cuda" region left the emulation's CPU autocast on (the head ran in the
    arm's format) and ``torch.is_autocast_enabled()`` read as off (the norm never cast)."""
    import torch
    import torch.nn.functional as F

    from precision_audit.policy import LossScaling, Policy, fingerprint, model_layout
    from precision_audit.verify import VerifyOptions, run_verify

    class Net(torch.nn.Module):
        def __init__(self, device: bool) -> None:
            super().__init__()
            self.fc, self.head, self.device = torch.nn.Linear(32, 32), torch.nn.Linear(32, 8), device

        def forward(self, x):
            dev = x.device.type if self.device else None
            h = self.fc(x)
            on = torch.is_autocast_enabled(dev) if dev else torch.is_autocast_enabled()
            if on:  # normalise in the autocast dtype, as Nemotron's LayerNorm does
                h = h.to(torch.get_autocast_dtype(dev or "cuda"))
            with torch.autocast(dev or "cuda", enabled=False):
                h = F.layer_norm(h, (32,))
                return self.head(h.float())

    def curves(device: bool) -> dict:
        torch.manual_seed(0)
        model = Net(device)
        fp, n = fingerprint(model)
        pol = Policy(model_class="Net", model_fingerprint=fp, model_modules=n, target_name="H100 SXM",
                     target_compute_capability=(9, 0), default_format="bf16", modules={},
                     loss_scaling=LossScaling(), model_layout=model_layout(model))
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        return run_verify(model, lambda m: m(x), lambda o: F.mse_loss(o, y), pol, "cpu", "emulated",
                          VerifyOptions(steps=3, lr=1e-2)).curves

    got, ref = curves(False), curves(True)
    assert got == ref
    assert got["bf16"] != got["fp32"] and got["fp16"] != got["bf16"]  # the formats did run (fc, the norm)


SPARSE = """
import torch, torch.nn as nn
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.emb = nn.Embedding(50, 16, sparse=True); s.head = nn.Linear(16, 3)
    def forward(s, x):
        return s.head(s.emb(x).mean(1))
def build_model():
    torch.manual_seed(0); return M()
def sample_batch():
    return torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(0))
"""


def test_verify_says_when_fp32_itself_cannot_train(tmp_path, capsys):
    """A sparse embedding under the default Adam: before, every arm failed and the policy was called "unsafe";
    now verify exits 2 naming the cause and the fix, and writes nothing. With SGD the same model verifies."""
    src = tmp_path / "model.py"
    src.write_text(SPARSE)
    audit = tmp_path / "audit"
    assert main([str(src), "--out", str(audit), "-q"]) == 0
    before = {p.name: p.read_bytes() for p in audit.iterdir() if p.is_file()}
    verify = ["verify", str(src), "--policy", str(audit / "policy.json"), "--out", str(audit), "--steps", "3", "-q"]
    assert main(verify) == 2
    err = capsys.readouterr().err
    assert "FP32 arm could not train" in err and "Adam does not support sparse gradients" in err
    assert "emb has sparse=True" in err and "--optimizer sgd" in err
    assert {p.name: p.read_bytes() for p in audit.iterdir() if p.is_file()} == before  # nothing written
    assert main(verify + ["--optimizer", "sgd"]) == 0
    curves = json.loads((audit / "audit.json").read_text())["verify"]["curves"]
    assert all(v is not None for c in curves.values() for v in c)
