"""The reference's random draws, recorded once and replayed in every other pass of a cuda-mode audit
(capture/rng_replay.py; docs/memory.md, "Random draws"), under the fake device (tests/fakecuda.py), whose
``cuda_dropout`` draws dtype-dependent dropout masks as CUDA's kernel does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import precision_audit as pa
from fakecuda import FakeCuda
from precision_audit.capture import CaptureConfig, CaptureSession
from precision_audit.capture.rng_replay import RandomDraws, recording, replaying
from precision_audit.formats import Format

# A fused attention kernel's dropout, as the memory-efficient kernel draws it: each element's mask from its position
# and the generator's state, whatever the dtype (a test-only op: the CPU has no fused attention with dropout).
_LIB = torch.library.Library("pa_test_rng_replay", "DEF")
_LIB.define("fused_dropout(Tensor q, float dropout_p) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,))


def _fused_dropout(q: torch.Tensor, dropout_p: float) -> torch.Tensor:
    keep = torch.rand(q.shape, device=q.device) >= dropout_p
    return (q.float() * keep / (1 - dropout_p)).to(q.dtype)


_LIB.impl("fused_dropout", _fused_dropout, "CompositeExplicitAutograd")
fused_dropout = torch.ops.pa_test_rng_replay.fused_dropout.default


def _held_tensors(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj`` through containers and attributes (whatever the record's layout)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    else:
        items = list(getattr(obj, "__dict__", {}).values())
        items += [getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)]
    return [t for x in items for t in _held_tensors(x, seen)]


class Dropouts(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, 4)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.head(self.drop(self.b(self.drop(self.a(x)))))


def test_the_reference_keeps_generator_states_not_masks():
    """Kept masks were one more activation-sized tensor per dropout, held on the device for the whole audit
    (~400 MB per layer for GPT-2 at 32 x 1024 tokens). The record holds a generator state before and after each
    draw, and the passes still see the reference's masks."""
    width, rows = 256, 256
    with FakeCuda(cuda_dropout=True):
        torch.manual_seed(0)
        model = Dropouts(width).train().to("cuda")
        x = torch.randn(rows, width, device="cuda")
        with CaptureSession(model, lambda m: m(x), lambda out: out.float().pow(2).mean(),
                            CaptureConfig(formats=(Format.BF16,), device="cuda", mode="cuda")) as s:
            s.reference_run()
            held = _held_tensors(s._draws)
            n_draws = len(s._draws)
            err = s.format_run(Format.BF16).output.rel_l2
            mismatches = s.state.draw_mismatches
    mask_elements = rows * width
    assert n_draws == 2
    assert held and max(t.numel() for t in held) < mask_elements / 4, \
        f"the record holds a tensor of {max(t.numel() for t in held)} elements: a mask is {mask_elements}"
    assert mismatches == 0 and err < 0.02, f"bf16 output error {err:.3g}: other masks than the reference's"


def test_a_recomputed_mask_is_the_references_whatever_the_passs_dtype():
    """The fake's dropout, as CUDA's, draws another mask in bf16 than in fp32 at the same state: the replay
    recomputes the reference's (fp32) draw, and applies it as CUDA's kernel does (fp32 math, rounded once)."""
    with FakeCuda(cuda_dropout=True):
        x = torch.randn(4096)
        torch.manual_seed(0)
        _, live16 = torch.native_dropout(x.bfloat16(), 0.5, True)
        draws = RandomDraws()
        torch.manual_seed(0)
        with recording(draws):
            y32, m32 = torch.native_dropout(x, 0.5, True)
        assert not torch.equal(live16, m32), "the fake's dropout should depend on the dtype"
        torch.manual_seed(1)
        torch.rand(7)  # the pass's generator is elsewhere: the replay does not read it
        with replaying(draws) as r:
            y16, m16 = torch.native_dropout(x.bfloat16(), 0.5, True)
    assert r.replayed == 1 and r.mismatches == 0
    assert torch.equal(m16, m32)
    assert torch.equal(y16, (x.bfloat16().float() * m32 * 2.0).bfloat16())


def test_fused_attention_dropout_runs_the_passs_kernel_from_the_references_state():
    """Its draws cannot be overwritten (they are inside the kernel): it runs on the pass's own inputs from the
    generator state the reference's call started at. Before, its output was replaced by the reference's."""
    q = torch.randn(8, 64)
    draws = RandomDraws()
    torch.manual_seed(0)
    torch.rand(64)  # the reference's generator position before the call
    with recording(draws):
        ref = fused_dropout(q, 0.5)
        fused_dropout(q, 0.0)  # no dropout: draws nothing, not recorded
    assert len(draws) == 1
    mask = ref != 0
    other = (q * 3).bfloat16()  # the pass's inputs: other values, other dtype
    torch.manual_seed(0)
    torch.rand(16)  # the pass's generator is elsewhere (a dtype-dependent draw before)
    with replaying(draws) as r:
        out = fused_dropout(other, 0.5)
        plain = fused_dropout(other, 0.0)
    assert r.mismatches == 0 and r.replayed == 1
    assert torch.equal(out, (other.float() * mask / 0.5).bfloat16())
    assert torch.equal(plain, other)


def test_attention_without_dropout_is_measured_not_replayed():
    """Fused attention ops are tagged as random whether or not they draw; the reference pass recorded their
    *output* and the later passes had it copied over theirs: under the fake device the attention's bf16 error
    read 1.7e-3 (the reference's output rounded) where the emulated audit of the same model reads 5.6e-3."""

    class Core(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.core = nn.Linear(32, 96), Core()

        def forward(self, x):
            q, k, v = self.qkv(x).view(x.shape[0], 8, 3, 2, 16).permute(2, 0, 3, 1, 4)
            return self.core(q, k, v).sum(1)

    def errors(device: str) -> dict[str, tuple[float, float]]:
        torch.manual_seed(0)
        model = Attention().eval().to(device)
        x = torch.randn(4, 8, 32, device=device) * 3
        a = pa.audit(model, x, loss_fn=lambda out, b: out.float().pow(2).mean(), device=device, steps=0,
                     progress=False, formats="bf16").audit
        return {L["name"]: (L["error"]["bf16"]["accumulated"]["rel_l2"], L["error"]["bf16"]["local"]["rel_l2"])
                for L in a["layers"]}

    emulated = errors("cpu")
    with FakeCuda():
        cuda = errors("cuda")
    assert cuda["core"] == pytest.approx(emulated["core"], rel=1e-6), (cuda["core"], emulated["core"])


class _SeesBackends(TorchFunctionMode):
    """Below the replay's mode: the SDPA backends enabled when scaled_dot_product_attention runs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, bool, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "scaled_dot_product_attention":
            b = torch.backends.cuda
            self.seen.append((b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled()))
        return func(*args, **(kwargs or {}))


def test_attention_with_dropout_runs_on_one_backend_for_every_dtype_without_the_s2_probabilities():
    """The memory-efficient kernel (the math one where it cannot run): FlashAttention has no fp32 kernel, so the
    reference could not draw its masks; the math backend, which every pass used before, keeps the S x S
    probabilities and their mask, O(S^2) per layer where a training step's kernel keeps O(S)."""
    q = torch.randn(2, 2, 8, 16)
    draws = RandomDraws()
    with _SeesBackends() as seen:
        torch.manual_seed(0)
        with recording(draws):
            ref = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
        with replaying(draws) as r:
            again = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert seen.seen == [(False, True, True)] * 2
    assert r.mismatches == 0 and torch.equal(ref, again)  # the CPU: the math backend, its mask replayed
