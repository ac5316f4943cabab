"""Issue 31 defect 3: each module's backward runs under the TF32 switches of its own forward (runtime/backward_tf32.py,
docs/policy.md "TF32 in the backward").

The switches are read where each weight's gradient is computed (a hook on the weight fires right after the GEMM that
computed it: AccumulateGrad runs first among ready nodes) and inside a module's backward (a probe node), in one model
that mixes the default format, strict fp32 modules (the first one fed by the batch, which needs no gradient), a tf32
module and a tf32 module inside a strict fp32 one. ``device_type="cuda"`` makes the wrappers switch TF32 on CPU
tensors (only the flags matter here)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import precision_audit as pa
from precision_audit.policy import LossScaling, ModuleOverride, Policy, fingerprint, model_layout
from precision_audit.tf32_switches import restore, snapshot, tf32_enabled

SEEN: list[tuple[str, tuple[bool, bool]]] = []


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, x):
        ctx.name = name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        SEEN.append((ctx.name, tf32_enabled()))
        return None, g


class Strict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.inner = nn.Linear(8, 8)

    def forward(self, x):
        return self.inner(_Probe.apply("strict-body", self.lin(x)))


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)  # strict fp32, its input is the batch (no gradient)
        self.mid = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))  # the default format
        self.strict = Strict()  # strict fp32, with a tf32 child
        self.fast = nn.Linear(8, 8)  # tf32
        self.head = nn.Linear(8, 4)  # the default format

    def forward(self, x):
        h = self.mid(self.first(x))
        h = h + self.strict(h)  # a residual around the strict block
        return self.head(torch.relu(self.fast(h)))


OVERRIDES = {"first": "fp32", "strict": "fp32", "strict.inner": "tf32", "fast": "tf32"}
OFF, ON = (False, False), (True, True)


def policy_for(model: nn.Module, default: str, matmul: bool, cudnn: bool) -> Policy:
    fp, n = fingerprint(model)
    return Policy(model_class="Mixed", model_fingerprint=fp, model_modules=n, target_name="H100 SXM",
                  target_compute_capability=(9, 0), default_format=default,
                  modules={k: ModuleOverride(v, "test") for k, v in OVERRIDES.items()},
                  loss_scaling=LossScaling(enabled=False), tf32_matmul=matmul, tf32_cudnn=cudnn,
                  model_layout=model_layout(model))


def expected(default_state: tuple[bool, bool]) -> dict[str, tuple[bool, bool]]:
    return {"first.weight": OFF, "mid.0.weight": default_state, "mid.2.weight": default_state,
            "strict.lin.weight": OFF, "strict-body": OFF, "strict.inner.weight": ON, "fast.weight": ON,
            "head.weight": default_state}


@pytest.fixture(params=["legacy-api", "fp32_precision-api"])
def user_switches(request):
    """The user's own switches (matmul off, cuDNN on: torch's defaults), set through the legacy flags or the newer
    ``fp32_precision`` API (after which reading a legacy flag raises), put back after the test."""
    saved = snapshot()
    if request.param == "legacy-api" or not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
    else:
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    yield snapshot()
    restore(saved)


def _watch(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        if name.endswith("weight"):
            p.register_hook(lambda g, name=name: SEEN.append((name, tf32_enabled())))


CASES = [("tf32", False, False, ON), ("fp32", True, False, (True, False)), ("bf16", False, False, OFF)]


@pytest.mark.parametrize("default,matmul,cudnn,default_state", CASES, ids=["tf32", "fp32+tf32-matmul", "bf16"])
@pytest.mark.parametrize("how", ["controller", "loss.backward"])
def test_each_modules_backward_runs_under_its_own_switches(default, matmul, cudnn, default_state, how,
                                                           user_switches):
    torch.manual_seed(0)
    model = Mixed()
    _watch(model)
    policy = policy_for(model, default, matmul, cudnn)
    handle = pa.apply_policy(model, policy, device_type="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = pa.controller(model, opt, policy, device="cpu") if how == "controller" else None
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for _ in range(2):
        SEEN.clear()
        with pa.autocast(policy, "cpu"):
            out = model(x)
            loss = F.mse_loss(out.float(), y)
        # the whole model's mark is left out where controller.step sets the same switches for the backward
        assert (type(out.grad_fn).__name__ == "_EnterBackward") == (ctl is None)
        if ctl is not None:
            ctl.step(loss)
        else:
            loss.backward()
        got = dict(SEEN)
        assert len(got) == len(SEEN), SEEN
        assert got == expected(default_state)
        assert snapshot() == user_switches, "the user's switches after the backward"
    handle.remove()
    if ctl is not None:
        ctl.close()


def test_a_gradient_for_some_inputs_only_still_restores_the_switches(user_switches):
    """torch.autograd.grad(loss, inputs) runs only the nodes that lead to ``inputs``: the exit marks of the modules
    it passes through may not run; the switches are still the user's when it returns."""
    torch.manual_seed(0)
    model = Mixed()
    _watch(model)
    policy = policy_for(model, "bf16", False, False)
    with pa.apply_policy(model, policy, device_type="cuda"):
        SEEN.clear()
        with pa.autocast(policy, "cpu"):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        (g,) = torch.autograd.grad(loss, [model.strict.inner.weight])
    assert torch.isfinite(g).all()
    assert dict(SEEN)["strict.inner.weight"] == ON
    assert snapshot() == user_switches


def test_no_gradient_no_marks():
    """Under no_grad (evaluation) the wrappers make no autograd nodes: outputs are plain tensors."""
    model = Mixed()
    policy = policy_for(model, "bf16", False, False)
    with pa.apply_policy(model, policy, device_type="cuda"), torch.no_grad():
        out = model(torch.randn(2, 8))
    assert out.grad_fn is None


def test_in_place_on_an_output_and_tuple_outputs_keep_working(user_switches):
    """The enter mark returns a detached alias of each output: an in-place op after it (a residual ``+=``) works as
    on the output itself, and tuple outputs keep their other items."""

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x), 7

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pair = Pair()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h, seven = self.pair(x)
            h += self.lin(x)
            return h * seven

    torch.manual_seed(0)
    model, reference = Net(), Net()
    reference.load_state_dict(model.state_dict())
    fp, n = fingerprint(model)
    policy = Policy(model_class="Net", model_fingerprint=fp, model_modules=n, target_name="t",
                    target_compute_capability=None, default_format="fp32",
                    modules={"pair": ModuleOverride("tf32", "test")}, loss_scaling=LossScaling(enabled=False),
                    model_layout=model_layout(model))
    x = torch.randn(3, 8)
    with pa.apply_policy(model, policy, device_type="cuda"):
        model(x).sum().backward()
    reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert snapshot() == user_switches


class Out(dict):
    """As Hugging Face's ModelOutput: a mapping whose items are also attributes."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        object.__setattr__(self, key, value)


def test_outputs_in_mappings_and_nested_tuples_are_marked(user_switches):
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.aux = nn.Linear(8, 8)

        def forward(self, x):
            out = Out()
            out["logits"] = self.lin(x)
            out["extra"] = ((self.aux(x), 3), "text")
            return out

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(8, 8)
            self.head = Head()

        def forward(self, x):
            return self.head(self.body(x))

    torch.manual_seed(0)
    model = Net()
    _watch(model)
    fp, n = fingerprint(model)
    policy = Policy(model_class="Net", model_fingerprint=fp, model_modules=n, target_name="t",
                    target_compute_capability=None, default_format="bf16",
                    modules={"head": ModuleOverride("tf32", "test")}, loss_scaling=LossScaling(enabled=False),
                    model_layout=model_layout(model))
    SEEN.clear()
    with pa.apply_policy(model, policy, device_type="cuda"):
        with pa.autocast(policy, "cpu"):
            out = model(torch.randn(3, 8))
        assert isinstance(out, Out) and out.logits is out["logits"] and out["extra"][0][1] == 3
        (out.logits.sum() + out["extra"][0][0].sum()).backward()
    assert dict(SEEN) == {"head.lin.weight": ON, "head.aux.weight": ON, "body.weight": OFF}
    assert snapshot() == user_switches
