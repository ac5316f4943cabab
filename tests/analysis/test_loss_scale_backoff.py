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
        s.t, s.i = F.normalize(s.a(x), dim=-1), F.normalize(s.b(y), dim=-1)
        s.sim = s.t @ s.i.t()  # an FP16 GEMM inside the root: its gradients are no module's output gradients
        for inner in (s.t, s.i, s.sim):
            if inner.requires_grad:
                inner.retain_grad()
        logits = s.sim * 50.0
        return {'loss': F.cross_entropy(logits, torch.arange(len(logits)))}
def build_model():
    torch.manual_seed(0); return M()
def sample_batch():
    g = torch.Generator().manual_seed(0)
    return {'x': torch.randn(4, 16, generator=g), 'y': torch.randn(4, 16, generator=g)}
"""


def _audit(tmp_path, source: str, name: str = "m") -> dict:
    d = tmp_path / name
    d.mkdir()
    (d / "model.py").write_text(source)
    main([str(d / "model.py"), "--out", str(d / "out"), "-q"])
    return json.loads((d / "out" / "audit.json").read_text())


def test_the_fp16_pass_backs_off_when_a_gradient_inside_a_module_overflows(tmp_path):
    audit = _audit(tmp_path, MODEL)
    ls, fp16 = audit["loss_scale"], audit["summary"]["fp16"]
    back = ls["backward_overflow"]
    assert back is not None and len(back["scales"]) >= 3, ls["reason"]
    # the hand-computed inner gradients (of the similarities and of the GEMM's operands), in FP32: every scale tried
    # overflows FP16 exactly when it says so
    ns: dict = {}
    exec(compile(MODEL, "model.py", "exec"), ns)
    model, batch = ns["build_model"](), ns["sample_batch"]()
    model(**batch)["loss"].backward()
    inner = max(float(t.grad.abs().max()) for t in (model.t, model.i, model.sim))  # the GEMM's output and inputs
    fp16_max = SPECS[Format.FP16].max
    for scale, bad in zip(back["scales"], back["nonfinite_param_grads"]):
        assert (inner * scale > fp16_max) == (bad > 0), (inner, scale, bad)
    finite = back["finite_at"]
    # the largest finite scale was found (twice it overflows), and the pass ran one doubling of headroom below it
    assert 2 * finite in back["scales"] and inner * 2 * finite > fp16_max >= inner * finite
    assert ls["max_no_overflow_scale"] == finite
    assert fp16["loss_scale"] == finite / 2 == ls["recommended_init_scale"] == back["scales"][-1]
    assert fp16["nonfinite"]["param_grads"] == 0 and fp16["safe"], fp16["verdict"]
    assert "the FP16 pass's own backward overflowing at 2^" in ls["reason"]


SCALE_INDEPENDENT = """
import torch, torch.nn as nn, torch.nn.functional as F
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.a = nn.Linear(16, 16); s.b = nn.Linear(16, 4)
    def forward(s, x, y):
        h = s.a(x) * 1e-9          # FP16: underflows to 0, FP32: ~1e-9
        z = torch.sqrt(h * h)      # its backward at 0 in FP16: 0 * inf = NaN, whatever the loss scale
        return F.cross_entropy(s.b(torch.relu(s.a(x))) + z[:, :4], y)
def build_model():
    torch.manual_seed(0); return M()
def sample_batch():
    g = torch.Generator().manual_seed(0)
    return {'x': torch.randn(8, 16, generator=g), 'y': torch.randint(0, 4, (8,), generator=g)}
"""


def test_a_non_finite_backward_at_every_scale_is_not_blamed_on_the_scale(tmp_path):
    """Finite at no scale down to 2^-24: the overflow is not the scale's doing. Nothing is capped, the pass is
    reported at the scale it started from, and FP16 stays unsafe."""
    audit = _audit(tmp_path, SCALE_INDEPENDENT)
    ls, fp16 = audit["loss_scale"], audit["summary"]["fp16"]
    back = ls["backward_overflow"]
    assert back["finite_at"] is None and all(n > 0 for n in back["nonfinite_param_grads"])
    assert min(back["scales"]) == 2.0**-24
    assert fp16["loss_scale"] == back["scales"][0] == back["scales"][-1] == ls["recommended_init_scale"]
    assert not fp16["safe"] and fp16["nonfinite"]["param_grads"] > 0
    assert "not the loss scale's doing" in ls["reason"]


SHARED = """
import torch, torch.nn as nn, torch.nn.functional as F
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.a = nn.Linear(16, 16); s.b = nn.Linear(16, 16)
        with torch.no_grad():
            s.a.weight.mul_(100.0); s.b.weight.mul_(100.0)
    def forward(s, x, y):
        h = s.a(x)                      # a call on the batch: measured in the format pass
        h = s.a(torch.tanh(h) * 0.5)    # a second call, on an intermediate: re-run in the reference pass
        t, i = F.normalize(h, dim=-1), F.normalize(s.b(y), dim=-1)
        return F.cross_entropy(50.0 * (t @ i.t()), torch.arange(len(t)))
def build_model():
    torch.manual_seed(0); return M()
def sample_batch():
    g = torch.Generator().manual_seed(0)
    return {'x': torch.randn(4, 16, generator=g), 'y': torch.randn(4, 16, generator=g)}
"""


def test_backing_off_keeps_the_reference_passs_figures(tmp_path, monkeypatch):
    """The forward is the same at every scale, so every forward figure (local and accumulated errors, among them a
    module's re-run on an intermediate input beside its call on the batch) and the loss impacts are the same with
    and without the back-off."""
    import precision_audit.audit as A
    from precision_audit.analysis import findings
    from precision_audit.planning import second_order

    impacts: list[dict] = []  # what each analysis read (an audit analyses again after a pass at the second order)
    orig = findings.analyse

    def spy(capture, *a, **k):
        impacts.append({r.name: (f.local.n if f.local else None, f.loss_impact, f.loss_impact_abs)
                        for r in capture.layers for f in [r.formats[Format.FP16]]})
        return orig(capture, *a, **k)

    monkeypatch.setattr(second_order, "analyse", spy)
    backed = _audit(tmp_path, SHARED, "backed")
    assert backed["loss_scale"]["backward_overflow"] is not None
    backed_impacts = impacts[-1]
    monkeypatch.setattr(A, "_back_off", lambda *a: None)
    plain = _audit(tmp_path, SHARED, "plain")
    assert plain["loss_scale"]["backward_overflow"] is None
    for x, y in zip(backed["layers"], plain["layers"]):
        assert x["error"]["fp16"] == y["error"]["fp16"], x["name"]
    assert backed_impacts == impacts[-1]
    assert backed_impacts["a"][0] == 2 * 64  # both calls' elements: the re-run's and the call on the batch's


def test_a_measured_overflow_caps_the_recommendation():
    """A hand-made histogram: its largest gradient, 1.0, allows 2^15 (2^16 x 1.0 reaches FP16's overflow), so 2^14
    with headroom; the FP16 pass finite at 2^10 and no higher caps it at 2^10, so 2^9."""
    h = MagnitudeHistogram()
    h.update(torch.tensor([1.0, 0.5, 1e-3]))
    free = recommend_loss_scale(h)
    assert (free.max_no_overflow_exponent, free.recommended_exponent) == (15, 14)
    measured = BackwardOverflow((16384.0, 4096.0, 1024.0, 2048.0, 512.0), (7, 7, 0, 7, 0))
    assert measured.finite_at == 1024.0 and measured.max_exponent == 10
    capped = recommend_loss_scale(h, backward_overflow=measured)
    assert (capped.max_no_overflow_exponent, capped.recommended_exponent) == (10, 9)
    assert capped.to_dict()["backward_overflow"] == {"scales": [16384.0, 4096.0, 1024.0, 2048.0, 512.0],
                                                      "nonfinite_param_grads": [7, 7, 0, 7, 0], "finite_at": 1024.0}
    assert capped.gradscaler_settles_exponent == 10 and capped.default_skipped_steps == 6
    assert math.ldexp(1.0, capped.recommended_exponent) == 512.0
    never = recommend_loss_scale(h, backward_overflow=BackwardOverflow((16384.0, 2.0**-24), (7, 7)))
    assert never.recommended_exponent == free.recommended_exponent  # not the scale's doing: no cap
