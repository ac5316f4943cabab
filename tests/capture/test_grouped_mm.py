"""torch._grouped_mm (the experts of a mixture of experts; transformers' "grouped_mm" experts): counted as GEMMs,
priced in FP32 under fp16/bf16 autocast (it is in no CUDA autocast list), and said so per layer and once per audit.
Before, its FLOPs were counted as elementwise bytes: the experts of a Mixtral had "gemm_ops": 0."""

from __future__ import annotations

import json

import pytest
import torch

from precision_audit.analysis.cost import gemm_time
from precision_audit.capture.ops import GEMM_REGISTRY, GemmOp
from precision_audit.emulation.autocast_policy import CUDA_POLICY
from precision_audit.formats import Format
from precision_audit.gpus import resolve_target

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
OFFS = torch.tensor([4, 8, 12], dtype=torch.int32)


def _brute_flops(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> tuple[int, torch.Tensor]:
    """2 x M x K x N per group, each group's GEMM written out (and its result, to check the layout read)."""
    bounds = [0, *offs.tolist()] if offs is not None else None
    flops, outs = 0, []
    for g in range(3):
        if a.dim() == 2 and b.dim() == 3:  # groups of rows
            x, w = a[bounds[g]:bounds[g + 1]], b[g]
        elif a.dim() == 3 and b.dim() == 3:
            x, w = a[g], b[g]
        elif a.dim() == 2 and b.dim() == 2:  # groups of the reduction
            x, w = a[:, bounds[g]:bounds[g + 1]], b[bounds[g]:bounds[g + 1]]
        else:  # 3-D x 2-D: groups of columns
            x, w = a[g], b[:, bounds[g]:bounds[g + 1]]
        flops += 2 * x.shape[0] * x.shape[1] * w.shape[1]
        outs.append(x @ w)
    if a.dim() == 2 and b.dim() == 3:
        return flops, torch.cat(outs)
    if a.dim() == 3 and b.dim() == 2:
        return flops, torch.cat(outs, dim=1)
    return flops, torch.stack(outs)


@pytest.mark.parametrize("layout", ["2d x 3d", "3d x 3d", "2d x 2d", "3d x 2d"])
def test_grouped_mm_flops_and_shape(layout):
    g = torch.Generator().manual_seed(0)
    a, b, offs = {
        "2d x 3d": (torch.randn(12, 16, generator=g), torch.randn(3, 16, 8, generator=g), OFFS),
        "3d x 3d": (torch.randn(3, 4, 16, generator=g), torch.randn(3, 16, 8, generator=g), None),
        "2d x 2d": (torch.randn(12, 4, generator=g).t(), torch.randn(12, 8, generator=g), OFFS),
        "3d x 2d": (torch.randn(3, 4, 16, generator=g), torch.randn(12, 16, generator=g).t(), OFFS),
    }[layout]
    out = torch._grouped_mm(a, b, offs)
    flops, want = _brute_flops(a, b, offs)
    torch.testing.assert_close(out, want)  # the layout is the one read
    op = GEMM_REGISTRY[torch.ops.aten._grouped_mm.default]((a, b, offs), {}, out)
    assert op.flops == flops and op.kind == "grouped_matmul"
    assert op.lowered is (CUDA_POLICY.get("_grouped_mm") is not None)
    assert not op.lowered and "no CUDA autocast list" in op.note  # torch 2.13's table


def test_an_unlowered_gemm_is_priced_in_fp32_under_autocast():
    target = resolve_target("h100")
    dims = (("M", "", 4096), ("N", "", 4096), ("K", "", 4096))
    lowered = GemmOp("mm", "matmul", 4096, 4096, 4096, 1, 2 * 4096 ** 3, dims)
    grouped = GemmOp("_grouped_mm", "grouped_matmul", 4096, 4096, 4096, 1, 2 * 4096 ** 3, dims, lowered=False)
    fp32 = gemm_time(lowered, Format.FP32, target)
    assert gemm_time(lowered, Format.BF16, target) < fp32 / 4  # Tensor Cores
    for f in (Format.BF16, Format.FP16, Format.FP32):
        assert gemm_time(grouped, f, target) == fp32


MOE = '''
import torch


class Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 64, 64) / 8)

    def forward(self, x):
        return torch._grouped_mm(x, self.w, torch.tensor([8, 16, 24, 32], dtype=torch.int32))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.experts, self.head = torch.nn.Linear(64, 64), Experts(), torch.nn.Linear(64, 8)

    def forward(self, x):
        # float32 into the experts, as a Mixtral's RMSNorm gives them (an fp16 input beside float32 expert
        # weights would make _grouped_mm raise, on a GPU too: autocast does not cast its arguments)
        return self.head(torch.relu(self.experts(self.up(x).float())))


def build_model():
    torch.manual_seed(0)
    return Net()


def sample_batch():
    return torch.randn(32, 64, generator=torch.Generator().manual_seed(1))


def loss_fn(out, batch):
    return out.pow(2).mean()
'''


def test_an_audit_says_which_gemms_autocast_leaves_in_fp32(tmp_path):
    from precision_audit.cli import main

    (tmp_path / "model.py").write_text(MOE)
    assert main([str(tmp_path / "model.py"), "--out", str(tmp_path / "o"), "-q"]) in (0, 1)
    a = json.loads((tmp_path / "o" / "audit.json").read_text())
    layer = next(L for L in a["layers"] if L["name"] == "experts")
    assert layer["cost"]["gemm_ops"] == 1 and layer["cost"]["flops"] == 2 * 32 * 64 * 64
    est = layer["cost"]["estimated_step_time_s"]
    assert est["bf16"] == est["fp16"] == est["fp32"]
    assert any("no CUDA autocast list" in n for n in layer["notes"])
    (w,) = [w for w in a["warnings"] if "no CUDA autocast list" in w]
    # the experts' 2x32x64x64 FLOPs of 2 x (2x32x64x64) + 2x32x64x8
    assert "_grouped_mm in experts" in w and w.startswith("47% of the model's GEMM FLOPs")
    # it ran in FP32 in the emulated passes too: no local error of its own
    assert all(e["local"]["rel_l2"] == 0 for e in layer["error"].values())
