"""The cost model's floor (issue 18 item 4): every kernel a step runs costs at least KERNEL_FLOOR_S, so an
estimated step is never below (kernels run) x the floor; the terminal carries the report's caveat."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from conftest import layer
from precision_audit.analysis.cost import (
    BACKWARD_GEMM_KERNELS,
    BACKWARD_OTHER_KERNELS,
    KERNEL_FLOOR_S,
    STEP_OVER_FORWARD,
    bytes_time,
    gemm_time,
    layer_cost,
    step_kernels,
)
from precision_audit.audit import AuditOptions, run_audit
from precision_audit.capture.ops import GemmOp, ModuleOps, record_op
from precision_audit.formats import Format
from precision_audit.gpus import resolve_target
from precision_audit.report.terminal import summary_text

H100 = resolve_target("h100")
FORMATS = (Format.FP32, Format.TF32, Format.BF16, Format.FP16)
aten = torch.ops.aten


def _gemm(m: int, n: int, k: int) -> GemmOp:
    return GemmOp("mm", "matmul", m, n, k, 1, 2 * m * n * k, (("M", "", m), ("N", "", n), ("K", "", k)))


def _tiny_ops() -> ModuleOps:
    """Two 4x4x4 matmuls and five elementwise ops on 16 elements, recorded as the op tracker records them."""
    ops = ModuleOps()
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    for _ in range(2):
        record_op(ops, aten.mm.default, (a, b), {}, a @ b)
    for _ in range(5):
        record_op(ops, aten.relu.default, (a,), {}, torch.relu(a))
    return ops


def test_known_kernel_count_of_a_hand_made_module():
    ops = _tiny_ops()
    assert sum(c for _, c in ops.gemms.values()) == 2 and ops.other_ops == 5
    # forward 2 GEMMs + 5 others; backward 2 GEMMs per GEMM and 1 kernel per other op
    assert (BACKWARD_GEMM_KERNELS, BACKWARD_OTHER_KERNELS) == (2, 1)
    assert step_kernels(ops) == 2 * 3 + 5 * 2 == 16
    for f in FORMATS:
        lc = layer_cost(ops, f, H100, 4)
        # every kernel here is far below a microsecond on the roofline: the step is exactly its floors
        assert lc.step_time_s == pytest.approx(16 * KERNEL_FLOOR_S, rel=1e-12)
        assert lc.floor_total_s == pytest.approx(16 * KERNEL_FLOOR_S, rel=1e-12)


def test_without_a_floor_it_is_the_plain_roofline():
    """floor 0 gives back the roofline model (3 x forward), so the floor is the only change."""
    ops = _tiny_ops()
    ops.add_gemm(_gemm(4096, 4096, 4096))
    for f in FORMATS:
        lc = layer_cost(ops, f, H100, 2, floor_s=0.0)
        fwd = sum(gemm_time(g, f, H100) * c for g, c in ops.gemms.values()) + bytes_time(ops.other_elements * 2, H100)
        assert lc.step_time_s == pytest.approx(STEP_OVER_FORWARD * fwd, rel=1e-12)


def test_a_large_gemm_is_above_its_floor():
    ops = ModuleOps()
    g = _gemm(8192, 8192, 8192)
    ops.add_gemm(g)
    lc = layer_cost(ops, Format.BF16, H100, 2)
    assert gemm_time(g, Format.BF16, H100) > 100 * KERNEL_FLOOR_S
    assert lc.step_time_s == pytest.approx(3 * gemm_time(g, Format.BF16, H100), rel=1e-12)


@pytest.mark.parametrize("floor", [0.0, 1e-6, 4e-6, 1e-4])
@pytest.mark.parametrize("size", [1, 64, 4096, 1 << 22])
def test_never_below_the_floors_nor_the_roofline(floor, size):
    ops = ModuleOps()
    ops.add_gemm(_gemm(size // 64 + 1, 64, 64))
    x = torch.zeros(size)
    record_op(ops, aten.gelu.default, (x,), {}, x)
    for f in FORMATS:
        lc = layer_cost(ops, f, H100, 4, floor_s=floor)
        roof = layer_cost(ops, f, H100, 4, floor_s=0.0).step_time_s
        assert lc.step_time_s >= step_kernels(ops) * floor * (1 - 1e-12)
        assert lc.step_time_s >= roof * (1 - 1e-12)


def test_fp8_uses_the_same_per_kernel_constant():
    from precision_audit.fp8 import cost as fp8_cost

    assert fp8_cost.KERNEL_LAUNCH_S is KERNEL_FLOOR_S or fp8_cost.KERNEL_LAUNCH_S == KERNEL_FLOOR_S


X_RELU_MUL = textwrap.dedent("""
    import torch
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(32, 32) * 0.1)
        def forward(self, x):
            return torch.relu(x @ self.w) * 2.0   # one mm, one relu, one mul: 3 + 2 + 2 = 7 kernels per step
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()
        def forward(self, x):
            return self.block(x).sum()
    def build_model():
        torch.manual_seed(0)
        return Net()
    def sample_batch():
        return torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
""")


def test_the_op_tracker_counts_the_kernels_a_module_ran(tmp_path):
    (tmp_path / "m.py").write_text(X_RELU_MUL)
    a = run_audit(AuditOptions(model=str(tmp_path / "m.py"), out=tmp_path / "out", steps=0)).audit
    c = layer(a, "block")["cost"]
    assert (c["gemm_ops"], c["other_ops"]) == (1, 2)
    for f, t in c["estimated_step_time_s"].items():
        assert t == pytest.approx(7 * KERNEL_FLOOR_S, rel=1e-12), f  # all tiny: exactly the floors
    assert any(s.startswith("this model: ") and "kernels per step" in s for s in a["estimates"]["assumptions"])


@pytest.mark.parametrize("name", ["mlp", "cnn", "tiny_gpt", "fp16_trouble"])
def test_sample_models_are_never_estimated_below_their_kernel_floors(sample_audits, name):
    """Property over the sample models: from the op counts audit.json records (the ops executed), each
    layer's estimate and the whole step are at least kernels x the floor, in every format."""
    a = sample_audits.audit_json(name)
    total_floor = 0.0
    for L in a["layers"]:
        c = L["cost"]
        if not c:
            continue
        floor = (c["gemm_ops"] * (1 + BACKWARD_GEMM_KERNELS) + c["other_ops"] * (1 + BACKWARD_OTHER_KERNELS)) \
            * KERNEL_FLOOR_S
        total_floor += floor
        for f, t in c["estimated_step_time_s"].items():
            assert t >= floor * (1 - 1e-12), (L["name"], f)
    assert total_floor > 0
    for f, t in a["estimates"]["step_time_s"].items():
        assert t >= total_floor * (1 - 1e-12), f
    for c in a["plan"].get("candidates") or []:
        if c.get("estimated_step_time_s") is not None:
            assert c["estimated_step_time_s"] >= total_floor * (1 - 1e-12)


def test_terminal_carries_the_reports_caveat(sample_audits):
    a = sample_audits.audit_json("tiny_gpt")
    text = summary_text(a)
    assert "est. step" in text
    assert f"estimates for {a['target']['name']} from the cost model, not measurements" in text
    assert "kernels per step, so no step is estimated below" in text
    # a record without estimates prints no caveat for figures it does not show
    b = json.loads(json.dumps(a))
    for s in b["summary"].values():
        s["step_time"]["estimated_s"] = None
        s["step_time"]["estimated_note"] = "not estimated: test"
    b["estimates"] = None
    assert "from the cost model, not measurements" not in summary_text(b)
