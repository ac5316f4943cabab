"""Issue 11, class 3: FP32's own non-finite values are reported as FP32's, and no low-precision format is judged
unsafe for them (docs/report.md, "FP32's own non-finite values").

Two hand-built models make inf/NaN in FP32 at known places:

- SIDE: a side branch ``side`` computes exp(1000) at 3 of 8 features; its output is returned but the loss does
  not use it. FP32 has 3 x batch non-finite module outputs (in ``side`` and in the model's output), finite grads.
- GATE: ``gate`` uses the "safe where" pattern, where(mask, y, exp(1000 + ...)): the forward is finite, but the
  backward of the unused exp branch is 0 * inf = NaN, so FP32's own parameter gradients are NaN (in ``gate.lin``
  and, through the input gradient, in ``a``). The loss uses the result.

The expected counts come from a plain FP32 forward/backward of the same model here, not from the audit.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import torch

from models import HEADER
from precision_audit.analysis.findings import Budget, _summary
from precision_audit.audit import AuditOptions, run_audit
from precision_audit.capture.records import RunRecord
from precision_audit.capture.stats import ErrorStats
from precision_audit.formats import Format
from precision_audit.record.schemas import validate_audit
from precision_audit.report.terminal import summary_text

SIDE = """
class Side(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("hot", torch.tensor([True, False, False, True, False, True, False, False]))

    def forward(self, x):
        return torch.exp(torch.where(self.hot, 1000.0, self.lin(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.side = Side()
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))), self.side(x)


def build_model():
    torch.manual_seed(0)
    return Net()


def loss_fn(output, batch):
    return output[0].pow(2).mean()  # the side branch is not used by the loss
"""

GATE = """
class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 8)
        self.register_buffer("hot", torch.tensor([False, True, False, False, False, False, True, False]))

    def forward(self, x):
        y = self.lin(x)
        z = torch.exp(torch.where(self.hot, 1000.0, 0.0) + 0.1 * y)  # inf where hot
        return torch.where(self.hot, y, z)  # finite; but d/dy of the unused branch is 0 * inf = NaN


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.gate = Gate()
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.b(self.gate(torch.relu(self.a(x))))


def build_model():
    torch.manual_seed(0)
    return Net()


def loss_fn(output, batch):
    return output.pow(2).mean()
"""

BATCH = 6


def _run(tmp_path: Path, body: str) -> tuple[dict, int, str]:
    (tmp_path / "model.py").write_text(HEADER + textwrap.dedent(body))
    torch.save(torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(1)), tmp_path / "batch.pt")
    result = run_audit(AuditOptions(model=str(tmp_path / "model.py"), batch=str(tmp_path / "batch.pt"),
                                    out=tmp_path / "out", formats=(Format.BF16, Format.FP16), steps=0))
    audit = json.loads((tmp_path / "out" / "audit.json").read_text())
    return audit, result.exit_code, result.html


def _reference(body: str) -> tuple[dict[str, int], dict[str, int]]:
    """Plain FP32 forward/backward: non-finite output values and own-parameter gradient values per module."""
    ns: dict = {}
    exec(HEADER + textwrap.dedent(body), ns)
    model = ns["build_model"]()
    x = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(1))
    outs: dict[str, int] = {}

    def hook(name):
        def h(m, i, o):
            ts = o if isinstance(o, tuple) else (o,)
            outs[name] = outs.get(name, 0) + sum(int((~torch.isfinite(t)).sum()) for t in ts)
        return h

    for name, m in model.named_modules():
        m.register_forward_hook(hook(name))
    ns["loss_fn"](model(x), x).backward()
    grads = {}
    for name, m in model.named_modules():
        n = sum(int((~torch.isfinite(p.grad)).sum()) for p in m.parameters(recurse=False) if p.grad is not None)
        grads[name] = n
    return {k: v for k, v in outs.items() if v}, {k: v for k, v in grads.items() if v}


def test_an_unused_branch_that_overflows_in_fp32_is_fp32s_not_the_formats(tmp_path):
    audit, code, html = _run(tmp_path, SIDE)
    validate_audit(audit)
    ref_outs, ref_grads = _reference(SIDE)
    assert ref_outs == {"side": 3 * BATCH, "": 3 * BATCH} and ref_grads == {}  # the hand-built case holds
    nf = audit["summary"]["fp32"]["nonfinite"]
    assert {m["name"]: m["outputs"] for m in nf["modules"]} == ref_outs
    assert nf["outputs"] == sum(ref_outs.values()) and nf["param_grads"] == 0
    assert "FP32 itself has" in nf["note"] and "side" in nf["note"]
    layers = {L["name"]: L for L in audit["layers"]}
    for f in ("bf16", "fp16"):
        s = audit["summary"][f]
        assert s["nonfinite"] == {"outputs": 0, "param_grads": 0, "param_grads_also_in_fp32": 0}, s["nonfinite"]
        assert s["output"]["fp32_nonfinite"] == 3 * BATCH and s["output"]["rel_l2"] is not None
        assert s["safe"], s["verdict"]
        err = layers["side"]["error"][f]["local"]
        assert err["nonfinite"] == 0 and err["fp32_nonfinite"] == 3 * BATCH and err["rel_l2"] is not None
        # the inf is not this format's: side is not pinned to fp32 for it
        assert "non-finite" not in layers["side"]["plan"]["reason"], layers["side"]["plan"]
    assert code == 0 and audit["verdict"]["safe_formats"] == ["bf16", "fp16"]
    assert any("FP32 itself has" in w for w in audit["warnings"])
    assert "FP32 itself has" in summary_text(audit)
    assert 'reference — <span class="bad">FP32 itself has' in html  # beside the FP32 row, not only in warnings


def test_nan_parameter_gradients_in_fp32_do_not_make_every_format_unsafe(tmp_path):
    audit, code, _ = _run(tmp_path, GATE)
    validate_audit(audit)
    _, ref_grads = _reference(GATE)
    assert set(ref_grads) == {"a", "gate.lin"}  # NaN in gate.lin, and through the input gradient in a
    nf = audit["summary"]["fp32"]["nonfinite"]
    got = {m["name"]: m["param_grads"] for m in nf["modules"] if m["param_grads"]}
    assert got == ref_grads and nf["param_grads"] == sum(ref_grads.values())
    layers = {L["name"]: L for L in audit["layers"]}
    assert layers["gate.lin"]["gradient"]["fp32_nonfinite"]["parameters"] == ref_grads["gate.lin"]
    for f in ("bf16", "fp16"):
        s = audit["summary"][f]
        # the same NaN in the format's pass: shared with FP32, none added
        assert s["nonfinite"]["param_grads"] == 0, s["verdict"]
        assert s["nonfinite"]["param_grads_also_in_fp32"] == sum(ref_grads.values())
        assert s["safe"] and "judged on what it adds" in s["verdict"], s["verdict"]
    assert code == 0 and set(audit["verdict"]["safe_formats"]) == {"bf16", "fp16"}
    text = summary_text(audit)
    assert "FP32 itself has" in text and "parameter-gradient" in text and "gate.lin" in text


def test_a_format_is_still_unsafe_for_the_non_finites_it_adds():
    """Judging on what a format adds must not hide what it does add (the verdict, from counts alone)."""
    run = RunRecord(format=Format.FP16, loss=1.0, loss_scale=1.0, output=ErrorStats(), output_nonfinite=0,
                    param_grads_nonfinite=5, param_grads_nonfinite_shared=40)
    s = _summary(run, 1.0, Budget())
    assert not s.safe and "5 non-finite parameter gradient element(s)" in s.verdict
    run.param_grads_nonfinite = 0
    assert _summary(run, 1.0, Budget()).safe


def test_error_metrics_leave_out_positions_where_fp32_is_not_finite():
    ref = torch.tensor([1.0, math.inf, 2.0, math.nan])
    e = ErrorStats()
    e.update(ref, torch.tensor([1.5, math.inf, 2.0, 7.0]))  # both inf: FP32's; 7 where FP32 is NaN: left out
    assert e.nonfinite == 0 and e.ref_nonfinite == 2 and e.n == 4
    assert math.isclose(e.rel_l2, 0.5 / math.sqrt(5.0)) and e.max_abs == 0.5
    e.update(torch.tensor([1.0, 1.0]), torch.tensor([math.inf, 1.0]))  # an inf where FP32 is finite: counted
    assert e.nonfinite == 1 and e.rel_l2 == math.inf


USED = """
class Hot(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("hot", torch.tensor([True, False, False, True, False, True, False, False]))

    def forward(self, x):
        return torch.exp(torch.where(self.hot, 1000.0, self.lin(x)))  # +inf in FP32 at the hot features


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.branch = Hot()
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.where(self.branch.hot, 0.0, self.branch(x)))  # used by the loss, its inf masked out


def build_model():
    torch.manual_seed(0)
    return Net()


def loss_fn(output, batch):
    return output.pow(2).mean()
"""


def test_a_used_branch_with_fp32_inf_has_a_finite_loss_impact_and_is_judged_on_the_rest(tmp_path):
    from precision_audit.audit import compute_audit

    (tmp_path / "model.py").write_text(HEADER + textwrap.dedent(USED))
    torch.save(torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(1)), tmp_path / "batch.pt")
    comp = compute_audit(AuditOptions(model=str(tmp_path / "model.py"), batch=str(tmp_path / "batch.pt"),
                                      out=tmp_path / "out", formats=(Format.BF16, Format.FP16), steps=0))
    branch = next(r for r in comp.capture.layers if r.name == "branch")
    assert branch.activation.infs == 3 * BATCH
    for f in (Format.BF16, Format.FP16):
        fs = branch.formats[f]
        # <dL/dy, y_p - y> over the positions finite in FP32 (dL/dy is 0 at the masked inf, and 0 * NaN is NaN)
        assert fs.impact_measured and math.isfinite(fs.loss_impact), fs.loss_impact
        assert fs.local.nonfinite == 0 and fs.local.ref_nonfinite == 3 * BATCH
    audit = comp.audit
    assert [m["name"] for m in audit["summary"]["fp32"]["nonfinite"]["modules"]] == ["branch"]
    assert set(audit["verdict"]["safe_formats"]) == {"bf16", "fp16"}
