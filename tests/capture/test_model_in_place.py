"""The audit runs on the user's model in place (no copy of it) and puts it back exactly (issue 14, docs/memory.md).

Each test takes a bit-for-bit picture of everything the user could see of the model — parameters and buffers
(values, and the same storage), existing ``.grad`` tensors (the same objects, ``None`` staying ``None``),
``requires_grad``, ``.training`` per module, plain attributes, every hook dictionary's contents, the global RNG
state — runs the capture with something going wrong at some point, and compares.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from torch import nn

from precision_audit.audit import AuditOptions, compute_audit
from precision_audit.capture import CaptureConfig, CaptureSession
from precision_audit.errors import ModelRunError
from precision_audit.formats import Format


class Net(nn.Module):
    """BatchNorm in train mode, dropout, an eval-mode submodule, a frozen parameter, and a forward that counts
    its calls (an attribute it rebinds) and can be told to fail on a given call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Tanh())
        self.out = nn.Linear(8, 3)
        self.out.bias.requires_grad_(False)  # frozen
        self.calls = 0
        self.fail_on: int | None = None
        self.fail_with: type[BaseException] = RuntimeError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.fail_on is not None and self.calls == self.fail_on:
            raise self.fail_with(f"injected on call {self.calls}")
        h = self.drop(torch.relu(self.bn(self.fc1(x))))
        return self.out(self.head(h) + h)


HOOK_ATTRS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
              "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
              "_state_dict_hooks", "_load_state_dict_pre_hooks")


def make_model() -> tuple[Net, torch.Tensor, dict[str, int]]:
    torch.manual_seed(3)
    model = Net().train()
    model.head.eval()  # an eval-mode submodule inside a train-mode model
    x = torch.randn(16, 6)
    # pre-existing gradients: fc1's from a real backward, bn.weight's explicit zeros, the rest None
    model(x).sum().backward()
    for p in (*model.bn.parameters(), *model.head.parameters(), *model.out.parameters()):
        p.grad = None
    model.bn.weight.grad = torch.zeros_like(model.bn.weight)
    with torch.no_grad():  # BatchNorm's running statistics away from their initial values
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    model.calls = 0
    fired = {"fc1": 0, "head_pre": 0}
    model.fc1.register_forward_hook(lambda m, a, y: fired.__setitem__("fc1", fired["fc1"] + 1))
    model.head.register_forward_pre_hook(lambda m, a: fired.__setitem__("head_pre", fired["head_pre"] + 1))
    return model, x, fired


def picture(model: nn.Module) -> dict:
    pic: dict = {"tensors": {}, "ptrs": {}, "grads": {}, "flags": {}, "training": {}, "attrs": {}, "hooks": {}}
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        pic["tensors"][n] = t.detach().clone()
        pic["ptrs"][n] = (t.data_ptr(), t.device, t.dtype, tuple(t.stride()))
    for n, p in model.named_parameters():
        pic["grads"][n] = None if p.grad is None else (id(p.grad), p.grad.clone())
        pic["flags"][n] = (p.requires_grad, type(p))
    for n, m in model.named_modules():
        pic["training"][n] = m.training
        pic["attrs"][n] = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else id(v))
                           for k, v in m.__dict__.items()}
        pic["hooks"][n] = {a: list(getattr(m, a).items()) for a in HOOK_ATTRS if hasattr(m, a)}
    pic["rng"] = torch.get_rng_state().clone()
    return pic


def assert_same(before: dict, model: nn.Module) -> None:
    after = picture(model)
    assert before["tensors"].keys() == after["tensors"].keys()
    for n, t in before["tensors"].items():
        a = after["tensors"][n]
        assert t.dtype == a.dtype and torch.equal(t.view(torch.int32), a.view(torch.int32)) \
            if t.dtype == torch.float32 else torch.equal(t, a), f"{n} is not bit-identical"
    assert after["ptrs"] == before["ptrs"], "parameters and buffers must keep their own storage"
    for n, g in before["grads"].items():
        a = after["grads"][n]
        if g is None:
            assert a is None, f"{n}.grad was None and must stay None"
        else:
            assert a is not None and a[0] == g[0], f"{n}.grad must be the user's own tensor"
            assert torch.equal(a[1], g[1]), f"{n}.grad changed"
    assert after["flags"] == before["flags"]
    assert after["training"] == before["training"]
    assert after["attrs"] == before["attrs"], "module attributes (the forward's call counter too) are put back"
    assert after["hooks"] == before["hooks"], "no hook left behind, the user's hooks kept"
    assert torch.equal(after["rng"], before["rng"]), "the global RNG state is restored"


def session(model, x, formats=(Format.FP16, Format.BF16)):
    return CaptureSession(model, lambda m: m(x), lambda y: y.float().pow(2).mean(), CaptureConfig(formats))


def full_capture(s: CaptureSession, steps: int = 1) -> None:
    s.reference_run()
    for f in s.config.formats:
        s.format_run(f)
    if steps:
        s.timed_steps(steps, traces=False)


def test_audit_runs_on_the_model_itself_and_puts_it_back_exactly():
    model, x, fired = make_model()
    ptr = model.fc1.weight.data_ptr()
    before = picture(model)
    with session(model, x) as s:
        assert s.model is model, "no copy of the model"
        full_capture(s)
        assert model.fc1.weight.data_ptr() == ptr
        assert model.calls > 0 and fired["fc1"] > 0, "the user's hooks run during the audit as in training"
    assert_same(before, model)
    # the user's hooks are still there and still fire
    n = dict(fired)
    model(x)
    assert fired["fc1"] == n["fc1"] + 1 and fired["head_pre"] == n["head_pre"] + 1


def test_a_forward_failing_on_the_second_pass_is_a_finding_and_the_model_is_restored():
    model, x, _ = make_model()
    model.fail_on = 2  # call 1: the FP32 reference; call 2: the FP16 pass
    before = picture(model)
    with session(model, x) as s:
        full_capture(s, steps=0)
        assert "injected on call 2" in (s.runs[Format.FP16].error or "")
        assert s.runs[Format.BF16].error is None
    assert_same(before, model)


# Where a Ctrl-C lands: the model's forward on call k (1: reference pass, 2, 3: format passes, 4+: timed
# steps), inside a child module during the reference pass (with local re-runs and statistics in flight), and
# in the backward pass (a gradient hook).
@pytest.mark.parametrize("call", [1, 2, 3, 5, 8])
def test_ctrl_c_in_any_forward_restores_the_model(call):
    model, x, _ = make_model()
    model.fail_on, model.fail_with = call, KeyboardInterrupt
    before = picture(model)
    with pytest.raises(KeyboardInterrupt):
        with session(model, x) as s:
            full_capture(s, steps=2)
    assert_same(before, model)


@pytest.mark.parametrize("where", ["child-forward", "backward"])
@pytest.mark.parametrize("on_call", [1, 2, 4])
def test_ctrl_c_inside_a_module_or_the_backward_restores_the_model(where, on_call):
    model, x, _ = make_model()
    count = {"n": 0}

    def interrupt():
        count["n"] += 1
        if count["n"] == on_call:
            raise KeyboardInterrupt

    if where == "child-forward":
        h = model.bn.register_forward_hook(lambda m, a, y: interrupt())
    else:
        h = model.bn.register_full_backward_hook(lambda m, gi, go: interrupt())
    before = picture(model)
    with pytest.raises(KeyboardInterrupt):
        with session(model, x) as s:
            full_capture(s, steps=2)
    assert_same(before, model)
    h.remove()


def test_an_error_while_entering_the_session_restores_the_model(monkeypatch):
    model, x, _ = make_model()
    before = picture(model)
    s = session(model, x)

    def fail() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(s, "_install_hooks", fail)
    with pytest.raises(KeyboardInterrupt):
        s.__enter__()
    assert_same(before, model)


class Writer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.fc.weight.mul_(0.5)  # a forward that writes into its own parameter
        return self.fc(x)


def test_a_forward_writing_into_a_parameter_is_refused_before_the_write():
    model = Writer()
    x = torch.randn(3, 4)
    before = picture(model)
    with pytest.raises(ModelRunError, match="writes into its own parameters") as e:
        with session(model, x, (Format.BF16,)) as s:
            s.reference_run()
    assert "'(model)'" in str(e.value.found)
    assert "does not modify its parameters" in e.value.hint
    assert_same(before, model)


class MaxNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(10, 4, max_norm=0.5), nn.Linear(4, 2)

    def forward(self, ids):
        return self.fc(self.emb(ids))


def test_an_embedding_with_max_norm_is_refused_with_its_own_fix():
    model = MaxNorm()
    ids = torch.tensor([[1, 2, 3]])
    before = picture(model)
    with pytest.raises(ModelRunError, match=r"embedding_renorm_") as e:
        with session(model, ids, (Format.BF16,)) as s:
            s.reference_run()
    assert "'emb'" in str(e.value.found) and "max_norm=None" in e.value.hint
    assert_same(before, model)  # the rows were not rescaled


USER_PKG = textwrap.dedent("""
    import torch
    from torch import nn
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(6, 8)
            self.bn = nn.BatchNorm1d(8)
            self.head = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Tanh())
            self.out = nn.Linear(8, 3)
        def forward(self, x):
            return self.out(self.head(torch.relu(self.bn(self.fc1(x)))))
    torch.manual_seed(0)
    MODEL = Net().train()
    MODEL.head.eval()
    MODEL.out.bias.requires_grad_(False)
    X = torch.randn(16, 6)
    MODEL(X).pow(2).mean().backward()
    MODEL.bn.weight.grad = None
    def sample_batch():
        return (X,)
    def loss_fn(y, batch):
        return y.pow(2).mean()
""")


@pytest.mark.parametrize("stop_at", [None, "bf16 pass", "analysing"])
def test_whole_audit_leaves_the_model_as_given_even_when_interrupted(tmp_path, monkeypatch, stop_at):
    name = f"in_place_pkg_{abs(hash(stop_at))}"
    (tmp_path / f"{name}.py").write_text(USER_PKG)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    mod = importlib.import_module(name)
    model = mod.MODEL
    fired = []
    model.head.register_forward_hook(lambda m, a, y: fired.append(1))
    before = picture(model)

    def progress(msg: str) -> None:
        if stop_at and msg.startswith(stop_at):
            raise KeyboardInterrupt

    try:
        if stop_at:
            with pytest.raises(KeyboardInterrupt):
                compute_audit(AuditOptions(model=f"{name}:MODEL", out=tmp_path / "out", steps=1), progress)
        else:
            c = compute_audit(AuditOptions(model=f"{name}:MODEL", out=tmp_path / "out", steps=1), progress)
            assert c.exit_code == 0
        assert fired, "the user's hook ran during the audit"
        assert_same(before, model)
    finally:
        sys.modules.pop(name, None)


def test_a_model_moved_to_the_audits_device_gets_its_own_tensors_back():
    """The device-move path (a CPU model audited on another device), exercised with the meta device: every
    parameter's original ``.data`` and every original buffer object come back, storage and all, and the grads
    stay the user's tensors on the user's device."""
    from precision_audit.capture import ModelState

    model, x, _ = make_model()
    extra = nn.Linear(2, 2)  # made before the picture: building it draws from the RNG (the session forks that)
    before = picture(model)
    state = ModelState(model, "meta")
    assert state.moved
    state.prepare()
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(b.device.type == "meta" for b in model.buffers())
    assert all(p.grad is None for p in model.parameters()), "the passes start without the user's gradients"
    state.reset_buffers()
    model.head.train()  # what a failed pass might leave behind
    model.fc1.weight.requires_grad_(False)
    model.extra = extra
    state.restore()
    assert not hasattr(model, "extra")
    assert_same(before, model)


class Counting(nn.Module):
    """Rebinds a registered buffer in its forward (a new tensor each call, not an in-place write)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count = self.count + 1
        return self.fc(x) * self.count


def test_a_rebound_buffer_starts_every_pass_from_the_users_value():
    """Every pass must see count = 1 in its forward, so every format is compared with the same reference."""
    model = Counting()
    x = torch.randn(3, 4)
    before = picture(model)
    with session(model, x) as s:
        ref = s.reference_run()
        runs = [s.format_run(f) for f in s.config.formats]
        assert all(r.error is None for r in runs)
        root = {r.name: r for r in s.result().layers}[""]
        for f in s.config.formats:
            # the same call count in every pass: the accumulated error stays at rounding size (x2 would be ~100%)
            assert root.formats[f].accumulated.rel_l2 < 0.05, (f, root.formats[f].accumulated.rel_l2)
    assert ref.loss is not None
    assert_same(before, model)
