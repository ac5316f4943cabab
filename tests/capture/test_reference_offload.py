"""The FP32 reference's kept tensors on the host when the audit runs on a GPU (docs/memory.md, "Reference
memory"): the outputs the format passes compare against and the local-error differences of the first-order
impacts. Run here under the fake CUDA device (tests/fakecuda.py), which checks the path and that it changes no
figure; tests/gpu/test_audit_memory_gpu.py measures the memory on a real GPU. On a CPU they go to a temporary
file instead: tests/capture/test_reference_spill.py."""

from __future__ import annotations

import torch
from torch import nn

from fakecuda import FakeCuda
from precision_audit.capture import CaptureConfig, CaptureSession, reference_store
from precision_audit.capture.reference_store import ReferenceStore
from precision_audit.formats import Format


class InPlace(nn.Module):
    """Outputs written over in place after they are seen (ReLU(inplace=True) on a Linear's output): a reference
    that aliased the output instead of copying it would read the overwritten values."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.act = nn.ReLU(inplace=True)
        self.b = nn.Linear(d, d)
        self.c = nn.Linear(d, 4)

    def forward(self, x):
        return self.c(self.act(self.b(self.act(self.a(x)))))


def _figures(offload: bool, monkeypatch) -> dict:
    real_init = ReferenceStore.__init__

    def init(self, device):
        real_init(self, device)
        self.offload = offload

    kept: list[torch.Tensor] = []
    real_stash = ReferenceStore.stash

    def stash(self, t):
        out = real_stash(self, t)
        if self.offload:
            kept.append(out)
        return out

    with monkeypatch.context() as mp:
        mp.setattr(ReferenceStore, "__init__", init)
        mp.setattr(ReferenceStore, "stash", stash)
        torch.manual_seed(0)
        model = InPlace()
        x = torch.randn(8, 16)
        with FakeCuda():
            with CaptureSession(model, lambda m: m(x), lambda out: out.float().pow(2).mean(),
                                CaptureConfig(formats=(Format.FP16, Format.BF16), device="cuda", mode="cuda",
                                              timed_steps=0)) as s:
                s.reference_run()
                for f in (Format.FP16, Format.BF16):
                    s.format_run(f)
                out = layer_figures(s.result())
    return {"figures": out, "kept": kept}


def layer_figures(result) -> dict:
    """Per (module, format): accumulated error (rel_l2, max_abs), local error, loss impact, whether measured."""
    return {(r.name, f.value): (fs.accumulated.rel_l2, fs.accumulated.max_abs, fs.local.rel_l2 if fs.local else None,
                                fs.loss_impact, fs.impact_measured)
            for r in result.layers for f, fs in r.formats.items()}


def test_offloaded_references_give_the_same_figures_as_references_kept_on_the_device(monkeypatch):
    on_device = _figures(False, monkeypatch)
    offloaded = _figures(True, monkeypatch)
    assert not on_device["kept"]
    # every module's output per call, and each format's local difference, went through the host store
    assert len(offloaded["kept"]) >= 4 + 3 * 2, len(offloaded["kept"])
    assert all(t.device.type == "cpu" for t in offloaded["kept"])
    assert offloaded["figures"] == on_device["figures"]
    impacts = [v[3] for v in offloaded["figures"].values() if v[4]]
    assert impacts and any(i != 0.0 for i in impacts), "first-order impacts were measured from the offloaded diffs"


def test_store_copies_on_a_gpu_and_keeps_cpu_tensors_in_place_when_not_spilling():
    t = torch.arange(6.0).reshape(2, 3)
    cpu = ReferenceStore("cpu", spill=False)
    assert not cpu.offload and not cpu.spilling
    assert cpu.stash(t) is t, "on a CPU device a diff the caller made is kept as is (no second copy)"
    c = cpu.keep(t)
    assert c.data_ptr() != t.data_ptr() and torch.equal(c, t), "a reference is a copy, not a view"
    assert cpu.on(c, t) is c
    gpu = ReferenceStore("cuda:0")
    assert gpu.offload and not gpu.spilling
    # no pinned allocator without CUDA: the store falls back to a pageable host copy, same values
    h = gpu.keep(t)
    assert h.device.type == "cpu" and h.data_ptr() != t.data_ptr() and torch.equal(h, t)
    t.add_(1)
    assert torch.equal(h, torch.arange(6.0).reshape(2, 3)), "the host copy does not follow the source"
    assert reference_store.ReferenceStore is ReferenceStore


def test_the_pinned_host_memory_goes_back_when_the_session_ends():
    """CUDA's host allocator rounds each pinned block up to a power of two and keeps it, pinned, once freed: the
    references' host copies stayed pinned in a training process for the rest of its life after
    ``precision_audit.audit()`` returned (FakeCuda.host models the allocator)."""
    import gc

    torch.manual_seed(0)
    model = InPlace()
    x = torch.randn(8, 16)
    with FakeCuda() as fake:
        with CaptureSession(model, lambda m: m(x), lambda out: out.float().pow(2).mean(),
                            CaptureConfig(formats=(Format.BF16,), device="cuda", mode="cuda", timed_steps=0)) as s:
            s.reference_run()
            s.format_run(Format.BF16)
            s.result()
            assert s.state.refs.pinned_used and fake.host.peak > 0, "the references went to pinned host memory"
        gc.collect()
        assert fake.host.active == 0, f"{fake.host.active} bytes of pinned blocks still held after the session"
        assert fake.host.cached_bytes == 0, f"{fake.host.cached_bytes} bytes of freed pinned blocks kept cached"
