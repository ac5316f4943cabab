"""The audit's peak GPU memory against one training step's (issue 14 item 2; docs/memory.md, "Reference memory").

On a GPU (``gpu`` marker): a residual MLP whose activations dominate its memory, as a training batch makes
them; ``torch.cuda.max_memory_allocated`` above what is allocated before (model and batch on the GPU) for one
FP32 forward+backward, then for the whole audit (``steps=0``): at most 1.25x. On the fake device
(tests/fakecuda.py) the memory counters are numbers a test drives, not measurements: there it checks that the
reference pass's kept tensors go to the host store and that the audit completes in cuda mode.
Run the real one with: python -m pytest -m gpu tests/gpu/test_audit_memory_gpu.py -q -s
"""

from __future__ import annotations

import torch
from torch import nn

import precision_audit
from fakecuda import gpu  # noqa: F401 - the fixture
from precision_audit.capture.reference_store import ReferenceStore

MAX_RATIO = 1.25


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Mlp(nn.Module):
    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, 16)

    def forward(self, x):
        return self.head(self.blocks(x))


def _loss(out, batch):
    return nn.functional.cross_entropy(out.float(), batch[1])


def _peak_above_start(fn, monkeypatch=None) -> int:
    """The peak allocation while ``fn`` runs, above what was allocated before. The audit's timed steps reset the
    peak statistics to measure each step's (capture/timing.py): with ``monkeypatch``, the peak before each of those
    resets is kept too."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    before_resets: list[int] = []
    if monkeypatch is not None:
        reset = torch.cuda.reset_peak_memory_stats

        def recording_reset(*a, **k):
            before_resets.append(torch.cuda.max_memory_allocated())
            reset(*a, **k)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", recording_reset)
    fn()
    torch.cuda.synchronize()
    return max([torch.cuda.max_memory_allocated(), *before_resets]) - start


def test_audit_peak_gpu_memory_within_a_training_step(gpu, monkeypatch):
    depth, width, rows = (8, 2048, 8192) if gpu.real else (2, 32, 8)
    torch.manual_seed(0)
    model = Mlp(depth, width).to("cuda")
    batch = (torch.randn(rows, width, device="cuda"), torch.randint(0, 16, (rows,), device="cuda"))
    offloaded: list[str] = []
    real_stash = ReferenceStore.stash

    def stash(self, t):
        out = real_stash(self, t)
        if self.offload:
            offloaded.append(out.device.type)
        return out
    monkeypatch.setattr(ReferenceStore, "stash", stash)

    def step():
        _loss(model(batch[0]), batch).backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up: cuBLAS workspaces and the allocator's first blocks belong to neither figure
    step_peak = _peak_above_start(step)
    result = []
    audit_peak = _peak_above_start(lambda: result.append(
        precision_audit.audit(model, batch, loss_fn=_loss, device="cuda", steps=0, progress=False)))
    assert result[0].audit["mode"] == "cuda"
    assert offloaded and set(offloaded) == {"cpu"}, "the reference's kept tensors go to the host"
    if gpu.real:
        ratio = audit_peak / step_peak
        print(f"peak above start: training step {step_peak / 2**20:.0f} MiB, audit {audit_peak / 2**20:.0f} MiB, "
              f"{ratio:.2f}x on {torch.cuda.get_device_name()}")
        assert ratio <= MAX_RATIO, f"audit peak {ratio:.2f}x one training step's (at most {MAX_RATIO}x)"


def test_audit_peak_gpu_memory_of_a_language_model_within_a_training_step(gpu, monkeypatch):
    """A GPT whose logits (batch x sequence x 50257 in FP32) are its largest tensors, audited with a timed step:
    the statistics' temporaries on the logits and their gradient were what set the audit's peak on GPT-2 and
    T5 at batch 32 (1.7-1.8x a training step; capture/stats.py's blocks, docs/memory.md)."""
    from conftest import ROOT
    from precision_audit.loading import load_model

    model, source = load_model(str(ROOT / "sample_models" / "tiny_gpt" / "model.py"))
    cfg = (dict(n_layer=4, d_model=512, n_head=8, vocab_size=50257, block_size=256) if gpu.real
           else dict(n_layer=1, d_model=32, n_head=2, vocab_size=1001, block_size=16))
    model = source.module.build_model(**cfg).to("cuda")
    rows, seq = (32, 256) if gpu.real else (2, 16)
    idx = torch.randint(0, cfg["vocab_size"], (rows, seq), device="cuda")
    batch = (idx, torch.roll(idx, -1, 1))
    loss_fn = source.module.loss_fn

    def step():
        loss_fn(model(batch[0]), batch).backward()
        model.zero_grad(set_to_none=True)

    step()
    step_peak = _peak_above_start(step)
    result = []
    audit_peak = _peak_above_start(lambda: result.append(
        precision_audit.audit(model, batch, loss_fn=loss_fn, device="cuda", steps=1, progress=False)), monkeypatch)
    assert result[0].audit["mode"] == "cuda"
    assert result[0].audit["summary"]["bf16"]["step_time"]["measured_s"] is not None
    if gpu.real:
        ratio = audit_peak / step_peak
        print(f"GPT, vocabulary 50257, {rows} x {seq} tokens: training step {step_peak / 2**20:.0f} MiB, audit "
              f"{audit_peak / 2**20:.0f} MiB, {ratio:.2f}x on {torch.cuda.get_device_name()}")
        assert ratio <= MAX_RATIO, f"audit peak {ratio:.2f}x one training step's (at most {MAX_RATIO}x)"
