"""An FP16 gradient inside a module, which no module outputs, can overflow at the scale the module-output
histograms recommend: CLIP's root scales its image-text similarities by exp(logit_scale) before the loss, so the
gradient of the unscaled similarity matrix is 14x the loss's (Hugging Face's CLIPModel from its default config:
126M non-finite parameter-gradient elements at 2^15, "fp16 unsafe"). The audit backs off as GradScaler does, and the
finding says so. The independent reference: that inner gradient computed by hand in FP32, times each scale,
against FP16's overflow threshold."""

from __future__ import annotations

import json
import math

import torch

from precision_audit.analysis.loss_scale import BackwardOverflow, recommend_loss_scale
from precision_audit.capture.stats import MagnitudeHistogram
from precision_audit.cli import main
from precision_audit.formats import SPECS, Format

MODEL = """
import torch, torch.nn as nn, torch.nn.functional as F
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.a = nn.Linear(16, 16); s.b = nn.Linear(16, 16)
        with torch.no_grad():  # long embeddings, as CLIP's projections give: normalizing them shrinks dL/dy
            s.a.weight.mul_(100.0); s.b.weight.mul_(100.0)
    def forward(s, x, y):
        t, i = F.normalize(s.a(x), dim=-1), F.normalize(s.b(y), dim=-1)
        s.sim = t @ i.t()  # an FP16 GEMM inside the root: its gradient is no module's output gradient
        if s.sim.requires_grad:
            s.sim.retain_grad()
        logits = s.sim * 50.0
        return F.cross_entropy(logits, torch.arange(len(logits)))
def build_model():
    torch.manual_seed(0); return M()
def sample_batch():
    g = torch.Generator().manual_seed(0)
    return {'x': torch.randn(4, 16, generator=g), 'y': torch.randn(4, 16, generator=g)}
"""


def test_the_fp16_pass_backs_off_when_a_gradient_inside_a_module_overflows(tmp_path):
    src = tmp_path / "model.py"
    src.write_text(MODEL)
    assert main([str(src), "--out", str(tmp_path / "out"), "-q"]) == 0
    audit = json.loads((tmp_path / "out" / "audit.json").read_text())
    ls, fp16 = audit["loss_scale"], audit["summary"]["fp16"]
    back = ls["backward_overflow"]
    assert back is not None and back["scales"], ls["reason"]
    # the hand-computed inner gradient dL/dsim, in FP32, at each scale
    ns: dict = {}
    exec(compile(MODEL, str(src), "exec"), ns)
    model, batch = ns["build_model"](), ns["sample_batch"]()
    model(**batch).backward()
    inner = float(model.sim.grad.abs().max())
    fp16_max = SPECS[Format.FP16].max
    for scale in back["scales"]:  # each scale it backed off from does overflow there
        assert inner * scale > fp16_max, (inner, scale)
    finite = back["finite_at"]
    assert finite == back["scales"][-1] / 4 and inner * finite < fp16_max
    assert fp16["loss_scale"] == finite == ls["recommended_init_scale"]  # the pass ran at what is recommended
    assert fp16["nonfinite"]["param_grads"] == 0 and fp16["safe"], fp16["verdict"]
    assert "the FP16 pass's own backward overflowing at 2^" in ls["reason"]
    assert audit["loss_scale"]["max_no_overflow_scale"] <= back["scales"][-1] / 2


def test_a_measured_overflow_caps_the_recommendation():
    """A hand-made histogram: one gradient of 1.0 allows 2^15 (2^16 x 1.0 overflows FP16's 65504 only by rounding
    past 65520? no: 65536 does), so 2^14 with headroom; a measured overflow at 2^12 caps it at 2^11, then 2^10."""
    h = MagnitudeHistogram()
    h.update(torch.tensor([1.0, 0.5, 1e-3]))
    free = recommend_loss_scale(h)
    assert (free.max_no_overflow_exponent, free.recommended_exponent) == (15, 14)
    capped = recommend_loss_scale(h, backward_overflow=BackwardOverflow((4096.0,), (7,), 1024.0))
    assert (capped.max_no_overflow_exponent, capped.recommended_exponent) == (11, 10)
    assert capped.to_dict()["backward_overflow"] == {"scales": [4096.0], "nonfinite_param_grads": [7],
                                                      "finite_at": 1024.0}
    assert capped.gradscaler_settles_exponent == 11 and capped.default_skipped_steps == 5
    assert math.ldexp(1.0, capped.recommended_exponent) == 1024.0
