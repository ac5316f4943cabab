"""The FP32 reference's kept tensors in a temporary file when the audit runs on a CPU (docs/memory.md, "Reference
memory"; capture/reference_store.py): exact values back, the same figures as kept in memory, nothing left in
the directory, space given back as tensors are dropped, memory file systems and a full disk handled."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn

import precision_audit
from precision_audit.capture import CaptureConfig, CaptureSession, reference_store
from precision_audit.capture.reference_store import ReferenceStore, Spilled
from precision_audit.formats import Format
from test_reference_offload import InPlace, layer_figures  # outputs written over in place after they are seen


@contextlib.contextmanager
def _session(spill: bool, monkeypatch, tmp_path, stores: list | None = None):
    """A capture session of InPlace whose reference store spills to ``tmp_path`` (or keeps in memory)."""
    real_init = ReferenceStore.__init__

    def init(self, device, spill_=True, directory=None):
        real_init(self, device, spill=spill, directory=str(tmp_path))
        if stores is not None:
            stores.append(self)

    with monkeypatch.context() as mp:
        mp.setattr(ReferenceStore, "__init__", init)
        torch.manual_seed(0)
        model = InPlace()
        x = torch.randn(8, 16)
        with CaptureSession(model, lambda m: m(x), lambda out: out.float().pow(2).mean(),
                            CaptureConfig(formats=(Format.FP16, Format.BF16), timed_steps=0)) as s:
            yield s


def _figures(spill: bool, monkeypatch, tmp_path) -> tuple[dict, ReferenceStore]:
    stores: list[ReferenceStore] = []
    with _session(spill, monkeypatch, tmp_path, stores) as s:
        s.reference_run()
        assert all(isinstance(r, Spilled) for calls in s.state.ref_outputs.values() for c in calls for r in c) == spill
        assert os.listdir(tmp_path) == [], "the file is unlinked as soon as it is made"
        for f in (Format.FP16, Format.BF16):
            s.format_run(f)
        out = layer_figures(s.result())
    return out, stores[0]


def test_spilled_references_give_the_same_figures_as_references_kept_in_memory(monkeypatch, tmp_path):
    in_memory, kept = _figures(False, monkeypatch, tmp_path)
    spilled, store = _figures(True, monkeypatch, tmp_path)
    assert not kept.spilling and kept._file is None
    # every module's output per call (5 modules, ReLU twice) and each format's local difference went to the file
    assert store._file is None, "closed when the session ends"
    assert spilled == in_memory
    impacts = [v[3] for v in spilled.values() if v[4]]
    assert impacts and any(i != 0.0 for i in impacts), "first-order impacts were measured from the spilled diffs"
    assert any(v[0] and v[0] > 0 for v in spilled.values()), "accumulated errors were measured against the file"


@pytest.mark.parametrize("make", [
    lambda: torch.randn(3, 5),
    lambda: torch.randn(4, 6).t(),  # not contiguous
    lambda: torch.randn(7).to(torch.bfloat16),
    lambda: torch.randn(2, 3).half(),
    lambda: torch.randn(2, 3).double(),
    lambda: torch.tensor(2.5),  # 0-dim
    lambda: torch.empty(0, 4),  # no bytes
    lambda: torch.tensor([float("nan"), float("inf"), -0.0, 1e-45]),
])
def test_a_spilled_tensor_comes_back_exactly(make, tmp_path):
    store = ReferenceStore("cpu", directory=str(tmp_path))
    assert store.spilling
    t = make()
    expect = t.clone()
    s = store.keep(t)
    assert isinstance(s, Spilled) and s.shape == t.shape and s.dtype == t.dtype
    if t.numel():
        t.fill_(7)  # the kept copy does not follow its source
    back = store.on(s, t)
    assert back.dtype == expect.dtype and back.shape == expect.shape
    assert torch.equal(back.view(-1).view(torch.uint8) if back.numel() else back,
                       expect.contiguous().view(-1).view(torch.uint8) if expect.numel() else expect)
    assert store.on(s, t) is not back, "each read is a fresh tensor, dropped after its statistic"
    store.close()


def test_dropped_tensors_give_their_space_back(tmp_path):
    store = ReferenceStore("cpu", directory=str(tmp_path))
    if reference_store._FALLOCATE is None:
        pytest.skip("no fallocate here")
    fd = store._file.fd
    kept = [store.keep(torch.ones(1 << 18)) for _ in range(8)]  # 8 x 1 MB
    used = os.fstat(fd).st_blocks * 512
    assert used >= 8 << 20
    del kept
    gc.collect()
    assert os.fstat(fd).st_blocks * 512 < 1 << 20, "the holes are punched as the handles go"
    assert os.fstat(fd).st_size == 8 << 20, "offsets stay unique: the file is only appended to"
    store.close()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_memory_file_system_keeps_the_tensors_in_memory(monkeypatch, tmp_path):
    monkeypatch.setattr(reference_store, "_file_system_type", lambda d: "tmpfs")
    store = ReferenceStore("cpu", directory=str(tmp_path))
    assert not store.spilling and store.note is None
    t = torch.randn(3)
    c = store.keep(t)
    assert isinstance(c, torch.Tensor) and torch.equal(c, t) and c.data_ptr() != t.data_ptr()


def test_without_positional_file_io_the_tensors_stay_in_memory(monkeypatch, tmp_path):
    monkeypatch.delattr(os, "preadv")  # Windows has neither pwrite nor preadv
    store = ReferenceStore("cpu", directory=str(tmp_path))
    assert not store.spilling
    t = torch.randn(3)
    assert torch.equal(store.keep(t), t)


def test_the_mount_table_names_the_file_system_of_a_directory(tmp_path):
    if not os.path.exists("/proc/self/mounts"):
        pytest.skip("no /proc")
    assert reference_store._file_system_type(str(tmp_path)) is not None
    if os.path.isdir("/dev/shm"):
        assert reference_store._file_system_type("/dev/shm") in ("tmpfs", None)


def test_a_full_directory_stops_the_spill_with_a_note(monkeypatch, tmp_path):
    store = ReferenceStore("cpu", directory=str(tmp_path))
    first = store.keep(torch.ones(4))
    assert isinstance(first, Spilled)
    monkeypatch.setattr(reference_store, "RESERVE_BYTES", 1 << 62)
    t = torch.arange(4.0)
    c = store.keep(t)
    assert isinstance(c, torch.Tensor) and torch.equal(c, t), "kept in memory instead"
    assert not store.spilling and "has less than 1 GiB free" in store.note and str(tmp_path) in store.note
    assert isinstance(store.keep(t), torch.Tensor), "and so are the later ones"
    assert torch.equal(store.on(first, t), torch.ones(4)), "what is in the file is still read from it"


def test_a_full_directory_is_a_warning_in_audit_json(monkeypatch, tmp_path):
    # the whole CLI path: the first tensor spills, then the file system reads full; the audit finishes with the
    # references in memory and says so
    sample = os.path.join(os.path.dirname(os.path.dirname(precision_audit.__file__)), "sample_models")
    calls = {"n": 0}
    real_write = reference_store._SpillFile.write

    def write(self, t):
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(28, "No space left on device")
        return real_write(self, t)

    monkeypatch.setattr(reference_store._SpillFile, "write", write)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    from precision_audit.audit import AuditOptions, run_audit
    out = tmp_path / "out"
    r = run_audit(AuditOptions(model=os.path.join(sample, "mlp", "model.py"),
                               batch=os.path.join(sample, "mlp", "sample.pt"), out=str(out)), lambda m: None)
    assert r.exit_code == 0
    warnings = json.loads((out / "audit.json").read_text())["warnings"]
    assert any("kept in memory" in w and "TMPDIR" in w for w in warnings), warnings


_FRAGMENTED_HEAP = """
import torch
from precision_audit.capture import reference_store

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

# 64 KB blocks (below glibc's mmap threshold: from the heap), each followed by a small block that stays, so the
# freed blocks cannot merge into the heap's top and be trimmed there
big, small = [], []
for _ in range(2000):
    big.append(torch.ones(1 << 14))
    small.append(torch.ones(16))
del big
before = rss()
reference_store.release_free_heap()
print(before - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or reference_store._TRIM is None, reason="glibc only")
def test_releasing_the_free_heap_gives_scattered_free_pages_back():
    # in a fresh process: in this one, what earlier tests left in the heap decides where the blocks go
    out = subprocess.run([sys.executable, "-c", _FRAGMENTED_HEAP], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) > 64 << 20, out.stdout


class Chain(nn.Module):
    """b's output feeds only c = relu, which saves its output, not its input: a training step frees b's output
    as soon as c has run."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = Double()
        self.c = nn.ReLU()
        self.d = nn.Linear(16, 4)

    def forward(self, x):
        return self.d(self.c(self.b(self.a(x))))


class Double(nn.Module):
    def forward(self, x):
        return x * 2


def test_the_passes_free_module_outputs_as_a_training_step_does():
    torch.manual_seed(0)
    model, x = Chain(), torch.randn(8, 16)
    seen: dict[str, list[bool]] = {}
    outs: list = []

    def keep_b(m, args, out):
        outs.append(weakref.ref(out))

    def at_d(m, args, out):
        if outs:
            seen.setdefault(phase[0], []).append(outs[-1]() is None)

    phase = ["?"]
    model.b.register_forward_hook(keep_b)
    model.d.register_forward_hook(at_d)
    # the same check in a plain training step: b's output is gone by the time d runs
    model(x).pow(2).mean().backward()
    assert seen["?"] == [True]
    model.zero_grad(set_to_none=True)
    with CaptureSession(model, lambda m: m(x), lambda out: out.float().pow(2).mean(),
                        CaptureConfig(formats=(Format.FP16, Format.BF16), timed_steps=0)) as s:
        phase[0] = "ref"
        s.reference_run()
        for f in (Format.FP16, Format.BF16):
            phase[0] = f.value
            s.format_run(f)
    # d's own re-runs call its hook too: every call, pass and re-run, sees b's output freed
    assert seen["ref"] and all(seen["ref"]), seen
    assert all(seen["fp16"]) and all(seen["bf16"]), seen


def _noise_floor(spill: bool, monkeypatch, tmp_path):
    from precision_audit.capture.noise import measure_noise_floor

    with _session(spill, monkeypatch, tmp_path) as s:
        s.reference_run()
        for f in (Format.FP16, Format.BF16):
            s.format_run(f)
        nf = measure_noise_floor(s, s.config.formats)
        kinds = {type(o) for o in nf.outputs or []}
        figures = (nf.reference_loss, nf.output_rel_error,
                   {f: (r.loss, r.output_rel_error) for f, r in nf.runs.items()})
    return kinds, figures


def test_the_noise_floors_fp32_outputs_are_kept_as_the_references_are(monkeypatch, tmp_path):
    """The FP32 output at the second order, which the format forwards and the plan's at that order compare
    against, is kept in the store (on the host on a GPU, in the file on a CPU), not as a copy on the device."""
    kinds, spilled = _noise_floor(True, monkeypatch, tmp_path)
    assert kinds == {Spilled}
    kinds_in_memory, in_memory = _noise_floor(False, monkeypatch, tmp_path)
    assert kinds_in_memory == {torch.Tensor}
    assert spilled == in_memory
    assert all(err is not None and err > 0 for _, err in spilled[2].values()), spilled


def test_the_audit_drops_the_noise_floors_kept_outputs_with_its_session(tmp_path):
    """They live in the session's store (a file on a CPU, pinned host memory on a GPU), which closes with the
    session: the computation the audit returns holds no handle into it."""
    from conftest import ROOT
    from precision_audit.audit import AuditOptions, compute_audit

    d = ROOT / "sample_models" / "mlp"
    c = compute_audit(AuditOptions(model=str(d / "model.py"), batch=str(d / "sample.pt"), out=tmp_path / "o",
                                   steps=0))
    assert c.analysis.noise is not None and c.analysis.noise.reference_loss is not None, "the noise floor was measured"
    assert c.analysis.noise.outputs is None
