"""The cost model's BF16-over-FP32 speed-up for the GPT of tests/gpu/test_performance_gpu.py, on the CPU in seconds.

    python bench/gpt_speedup_estimate.py [--target h100,h200] [--layers 12 --width 1024 --batch 16 --seq 512
                                         --vocab 50304]

The audit's estimate is performance() over the capture's per-module op records (analysis/performance.py): each
module's own GEMMs and other ops (capture/ops.py ``record_op``, counted under the innermost module as the reference
pass's op tracker counts them), priced by analysis/cost.py with the module's output element size in each format.
Here the same records come from one forward of the model (sample_models/tiny_gpt at the test's sizes) on the
``meta`` device, where nothing is computed, and the output element sizes from the same model at width 64 and 16
tokens under the emulation of CUDA's BF16 autocast (a module's output dtype does not depend on its size): a
200M-parameter model at 8192 tokens is estimated in seconds, where auditing it on a CPU would take an hour. The
figure is the audit's ``estimates.speedup_vs_fp32.bf16`` for that model and target (docs/gpu.md, "The cost
model's calibration"); tests/gpu/test_performance_gpu.py measures the real speed-up on a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from precision_audit.analysis.cost import layer_cost  # noqa: E402
from precision_audit.capture.emulation import CudaAutocastPolicy, emulated_autocast  # noqa: E402
from precision_audit.capture.op_tracker import _NON_COMPUTE  # noqa: E402
from precision_audit.capture.ops import AutocastWidths, ModuleOps, record_op  # noqa: E402
from precision_audit.formats import Format  # noqa: E402
from precision_audit.gpus import resolve_target  # noqa: E402

OUTSIDE = "<outside every module>"


class PerModule(TorchDispatchMode):
    """Each compute op of a forward, recorded under the innermost module running it (as capture/op_tracker.py)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.ops: dict[str, ModuleOps] = {}
        self.float32_out: dict[str, bool] = {}
        self.stack: list[str] = []
        self.widths = AutocastWidths()
        self.hooks = []
        for name, m in model.named_modules():
            self.hooks.append(m.register_forward_pre_hook(lambda mod, a, n=name: self.stack.append(n)))
            self.hooks.append(m.register_forward_hook(lambda mod, a, out, n=name: self._done(n, out)))

    def _done(self, name: str, out) -> None:
        self.stack.pop()
        outs = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]
        self.float32_out[name] = self.float32_out.get(name, False) or any(t.dtype == torch.float32 for t in outs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        low_bytes, cast_bytes = self.widths.after(func, args, kwargs, out)
        if not func.is_view and func not in _NON_COMPUTE:  # the loss outside every module: OUTSIDE
            record_op(self.ops.setdefault(self.stack[-1] if self.stack else OUTSIDE, ModuleOps()), func, args,
                      kwargs, out, low_bytes, cast_bytes)
        return out


def _base():
    spec = importlib.util.spec_from_file_location("tiny_gpt_base", ROOT / "sample_models/tiny_gpt/model.py")
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    return base


def build(layers: int, width: int, seq: int, vocab: int, device: str) -> torch.nn.Module:
    base = _base()
    with torch.device(device):
        return base.build_model(n_layer=layers, d_model=width, vocab_size=vocab, block_size=seq,
                                n_head=max(1, width // 64))


def _fused_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
    """The meta device has no fused attention (it decomposes it into matmuls and softmax): as on a GPU, one fused
    kernel, recorded as the attention GEMM the audit records for CUDA's flash attention (capture/ops.py)."""
    assert attn_mask is None and dropout_p == 0.0, "a fused attention without mask or dropout"
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)[0]


def records(layers: int, width: int, batch: int, seq: int, vocab: int) -> tuple[PerModule, PerModule]:
    """The full-size model's op records (meta device), and the small BF16 run's module output dtypes."""
    model = build(layers, width, seq, vocab, "meta")
    full = PerModule(model)
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _fused_sdpa
    try:
        idx = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        with full:
            _base().loss_fn(model(idx), (idx, idx))
    finally:
        torch.nn.functional.scaled_dot_product_attention = real_sdpa
    small_model = build(layers, 64, 16, vocab, "cpu")
    small = PerModule(small_model)
    with torch.no_grad(), CudaAutocastPolicy(), emulated_autocast(torch.bfloat16):
        small_model(torch.zeros(1, 16, dtype=torch.long))
    return full, small


def estimate(full: PerModule, small: PerModule, fmt: Format, target) -> float:
    """The audit's estimated step of ``fmt`` on ``target`` (analysis/performance.py's sum over modules)."""
    total = 0.0
    for name, ops in full.ops.items():
        nbytes = 4 if fmt in (Format.FP32, Format.TF32) or small.float32_out.get(name, True) else 2
        total += layer_cost(ops, fmt, target, nbytes).step_time_s
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="h100,h200")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=50304)
    a = p.parse_args()
    full, small = records(a.layers, a.width, a.batch, a.seq, a.vocab)
    for name in a.target.split(","):
        target = resolve_target(name)
        fp32, bf16 = (estimate(full, small, f, target) for f in (Format.FP32, Format.BF16))
        print(f"{target.name}: fp32 {fp32 * 1e3:.2f} ms, bf16 {bf16 * 1e3:.2f} ms: BF16 over FP32 {fp32 / bf16:.2f}x")


if __name__ == "__main__":
    main()
