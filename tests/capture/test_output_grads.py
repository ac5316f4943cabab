"""dL/dy of a module output that is a view a later op changes in place (capture/output_grads.py).

The independent reference: the same model with the view replaced by a copy (``.clone()`` inside the module), whose
output is no view, so autograd's own tensor-hook semantics give dL/dy of the value returned; the clone changes no
value, so every figure must be equal."""

from __future__ import annotations

import json
import weakref
from types import SimpleNamespace

import pytest
import torch

from precision_audit.capture.noise import second_order_impacts
from precision_audit.capture.output_grads import OutputGradHooks, autograd_nodes
from precision_audit.capture.session import NO_GRAD_NOTE, CaptureConfig, CaptureSession
from precision_audit.cli import main
from precision_audit.formats import Format


def _dldy_by_copy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, change, use_early: bool) -> torch.Tensor:
    """dL/dy0 for y0 = x @ w.T + b, the in-place change made on a copy of it: the gradient of the value returned."""
    y0 = torch.nn.functional.linear(x, w, b)
    y = y0.clone()
    (grad,) = torch.autograd.grad(_loss(y, change, use_early), y0)
    return grad


def _loss(y: torch.Tensor, change, use_early: bool) -> torch.Tensor:
    weights = torch.arange(y.numel(), dtype=y.dtype).view(y.shape) / y.numel()
    early = (y * weights).sum() * 0.3 if use_early else 0.0  # saves no y: the change below is allowed
    change(y)
    return (torch.tanh(y) * weights).sum() + early


@pytest.mark.parametrize("use_early", [False, True])
@pytest.mark.parametrize("change", ["mul", "slice"], ids=["whole", "part"])
def test_a_view_changed_in_place_gets_the_gradient_of_the_value_returned(use_early, change):
    fn = {"mul": lambda y: y.mul_(0.5), "slice": lambda y: y[:, :, 1:].add_(1.0)}[change]
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 3, 4, generator=g), torch.randn(5, 4, generator=g, requires_grad=True)
    b = torch.randn(5, generator=g, requires_grad=True)

    want = _dldy_by_copy(x, w, b, fn, use_early)
    y = torch.nn.functional.linear(x, w, b)  # a 3-D input with a bias: a view of the 2-D addmm
    assert y._is_view()
    got, lost = [], []
    hooks = OutputGradHooks()
    hooks.register(y, lambda gr: got.append(gr.clone()), lambda: lost.append(1))
    loss = _loss(y, fn, use_early)
    assert hooks.settle(loss) is True
    loss.backward()
    assert lost == [] and len(got) == 1
    assert got[0].shape == want.shape and torch.equal(got[0], want)


def test_a_part_of_a_larger_tensor_changed_in_place_is_reported_lost_not_partial():
    w = torch.randn(6, 4, requires_grad=True)
    base = torch.randn(3, 4) @ w.t()
    y = base[:, :3]  # a view of part of the base
    got, lost = [], []
    hooks = OutputGradHooks()
    hooks.register(y, lambda gr: got.append(gr), lambda: lost.append(1))
    early = y.sum()  # fires the old node with this use's gradient only: partial
    y.mul_(2.0)
    loss = (base * base).sum() + early
    assert hooks.settle(loss) is True
    loss.backward()
    assert lost == [1] and got == []


def test_a_view_left_unchanged_and_a_plain_tensor_keep_the_tensor_hook():
    w = torch.randn(5, 4, requires_grad=True)
    y = torch.nn.functional.linear(torch.randn(2, 3, 4), w, torch.zeros(5))
    assert y._is_view()
    z = torch.randn(3, 4) @ w.t()
    z.mul_(3.0)  # not a view: autograd's own hook semantics (the value before the change)
    got: dict[str, list] = {"y": [], "z": []}
    hooks = OutputGradHooks()
    hooks.register(y, lambda gr: got["y"].append(gr))
    loss = (y * 2).sum() + z.sum()
    assert hooks.settle(loss) is False
    loss.backward()
    assert len(got["y"]) == 1 and torch.equal(got["y"][0], torch.full_like(y, 2.0))


class _CopyLinear(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x).clone()


class _Changed(torch.nn.Module):
    """fc's output (a view: 3-D input) is changed in place after the module returned it, once also used before."""

    def __init__(self, copy: bool, early: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.fc = (_CopyLinear if copy else torch.nn.Linear)(16, 16)
        self.head = torch.nn.Linear(16, 32)
        self.early = early

    def forward(self, ids):
        y = self.fc(self.emb(ids))
        z = (y * torch.linspace(-1.0, 1.0, 16)).mean() if self.early else 0.0  # saves no y: the change is allowed
        y.mul_(0.5)
        return self.head(torch.tanh(y)) + z


@pytest.mark.parametrize("early", [False, True])
def test_the_audits_figures_for_a_view_changed_in_place_equal_the_copys(early):
    def figures(copy: bool):
        torch.manual_seed(0)
        model, ids = _Changed(copy, early), torch.randint(0, 32, (4, 8))
        with CaptureSession(model, lambda m: m(ids), lambda y: y.pow(2).mean(),
                            CaptureConfig((Format.FP16, Format.BF16))) as s:
            s.reference_run()
            for f in (Format.FP16, Format.BF16):
                s.format_run(f)
            second, note = second_order_impacts(s, 1)
            assert note is None
            fc = next(r for r in s.layers.values() if r.name == "fc")
            return (fc.grad_output.counts.tolist(), {k: h.counts.tolist() for k, h in fc.grad_output_own.items()},
                    {f: (fs.impact_measured, fs.loss_impact, fs.grad_output.amax, fs.grad_output.total)
                     for f, fs in fc.formats.items()},
                    second["fc"], fc.notes)

    view, copy = figures(False), figures(True)
    assert view == copy
    assert all(measured for measured, *_ in view[2].values())
    assert view[3][Format.FP16] and view[3][Format.BF16]


class _Node:
    """An autograd node as torch 2.11 hands it to Python: a wrapper made on access, kept only while something
    holds it (a weak cache), so that a freed wrapper's id may come back as another node's."""

    _cache: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def __init__(self, key: str, graph: dict[str, list[str]]) -> None:
        self.key, self._graph = key, graph

    @classmethod
    def of(cls, key: str, graph: dict[str, list[str]]) -> _Node:
        node = cls._cache.get(key)
        if node is None:
            node = cls(key, graph)
            cls._cache[key] = node
        return node

    @property
    def next_functions(self) -> tuple:
        return tuple((_Node.of(k, self._graph), 0) for k in self._graph[self.key])


def test_the_graph_walk_visits_every_node_once_when_node_objects_are_made_on_access():
    # a ladder of diamonds: every node below the top reachable along two paths, 61 nodes in all
    graph: dict[str, list[str]] = {}
    for i in range(20):
        graph[f"top{i}"] = [f"left{i}", f"right{i}"]
        graph[f"left{i}"] = [f"top{i + 1}"]
        graph[f"right{i}"] = [f"top{i + 1}"]
    graph["top20"] = []
    loss = SimpleNamespace(grad_fn=_Node.of("top0", graph))
    visited = [n.key for n in autograd_nodes(loss)]
    assert sorted(visited) == sorted(graph), f"visited {len(visited)} of {len(graph)} nodes"


NO_GRAD = """
import torch, torch.nn as nn
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.frozen = nn.Linear(8, 16); s.l = nn.Linear(16, 2)
    def forward(s, x):
        with torch.no_grad():
            h = s.frozen(x)
        return s.l(h.relu())
def build_model():
    torch.manual_seed(0); return M()
def sample_batch():
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
"""


def test_a_module_whose_output_needs_no_grad_says_its_gradient_is_not_measured(tmp_path):
    """Its output-gradient figures are an empty histogram (amax 0.0): the note says they are not zero gradients.
    (Hugging Face's Reformer runs its layers inside its own autograd Function, whose forward records no graph.)"""
    src = tmp_path / "model.py"
    src.write_text(NO_GRAD)
    assert main([str(src), "--out", str(tmp_path / "out"), "-q"]) == 0
    layers = {L["name"]: L for L in json.loads((tmp_path / "out" / "audit.json").read_text())["layers"]}
    assert layers["frozen"]["notes"] == [NO_GRAD_NOTE] and layers["frozen"]["gradient"]["output"]["amax"] == 0.0
    assert NO_GRAD_NOTE not in layers["l"]["notes"] and layers["l"]["gradient"]["output"]["amax"] > 0
