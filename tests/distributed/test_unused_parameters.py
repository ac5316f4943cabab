"""Parameters no loss reaches under DDP (precision_audit/distributed/unused.py): a model with an unused head audits
across ranks as in one process (before: every format pass raised DDP's "Expected to have finished reduction in the
prior iteration" and the plan fell back to FP32), and a parameter only some ranks use is refused by name."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.utils.checkpoint as cp

from precision_audit.distributed.unused import reached_parameters
from test_distributed_audit import _compare, audit

UNUSED_HEAD = """
import torch, torch.nn as nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 128)
        self.pooler = nn.Linear(128, 128)  # never used, as BERT's pooler under a masked-LM head
        self.b = nn.Linear(128, 16)
    def forward(self, x):
        return self.b(torch.relu(self.a(x)))
def build_model():
    torch.manual_seed(0); return Net()
def sample_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 64, generator=g), torch.randint(0, 16, (32,), generator=g)
"""

TRAINING_ONLY = """
import torch, torch.nn as nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 128)
        self.aux = nn.Linear(128, 128)  # used in training only, as an auxiliary loss head
        self.b = nn.Linear(128, 16)
    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.training:
            h = h + 0.1 * self.aux(h)
        return self.b(h)
def build_model():
    torch.manual_seed(0); return Net()
def sample_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 64, generator=g), torch.randint(0, 16, (32,), generator=g)
"""

SOME_RANKS = """
import torch, torch.nn as nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)
    def forward(self, x):
        y = self.a(x)
        if x[0, 0] > 0:  # the first row of rank 0's share, not of rank 1's
            y = self.extra(y)
        return self.b(y)
def build_model():
    torch.manual_seed(0); return Net()
def sample_batch():
    x = torch.randn(8, 8); x[0, 0] = 1.0; x[4, 0] = -1.0
    return x, torch.randint(0, 4, (8,))
"""


def test_the_walk_finds_what_the_loss_reaches():
    a, b, c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)
    x = torch.randn(2, 3)
    loss = b(a(x) + a.weight.sum()).sum()  # a used twice, c never
    reached = reached_parameters(loss)
    assert [p in reached for p in (a.weight, a.bias, b.weight, b.bias, c.weight, c.bias)] == [True] * 4 + [False] * 2
    assert len(reached) == 4
    # a reentrant checkpoint runs its forward unrecorded: its parameters are not in the graph, so no answer
    loss = cp.checkpoint(c, a(x).requires_grad_(), use_reentrant=True).sum()
    assert reached_parameters(loss) is None


class _Node:
    """A graph node as the walk reads it (``next_functions``; an AccumulateGrad's ``variable``)."""

    def __init__(self, *after, variable=None):
        self.next_functions = tuple((n, 0) for n in after)
        if variable is not None:
            self.variable = variable


def test_a_leaf_given_back_as_another_python_object_is_still_its_parameter():
    """On torch 2.11 with CUDA (an H200), ``AccumulateGrad.variable`` gave other Python objects than the model's
    parameters: matched by id, every parameter looked unused, DDP was told to leave them all out and refused the
    model ("DistributedDataParallel is not needed when a module doesn't have any parameter that requires a
    gradient"). Here the graph hands back views of the parameters: the same memory, other objects."""
    a, c = nn.Linear(3, 3), nn.Linear(3, 3)
    loss = SimpleNamespace(grad_fn=_Node(_Node(variable=a.weight.detach()), _Node(variable=a.bias.view(3))))
    reached = reached_parameters(loss)
    assert reached is not None
    assert [p in reached for p in (a.weight, a.bias, c.weight, c.bias)] == [True, True, False, False]
    assert a.weight.detach().t() not in reached, "another shape over the same memory is another tensor"


def test_a_graph_reaching_no_parameter_leaves_none_out(monkeypatch):
    """A loss that needs gradients but whose graph, as read, reaches none of the trainable parameters: nothing is
    left out of DDP's reduction (leaving every parameter out is what DDP refuses)."""
    from precision_audit.distributed import unused

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    source = SimpleNamespace(module=SimpleNamespace())
    batch = SimpleNamespace(args=(torch.randn(3, 4),), kwargs={}, to=lambda device: batch)
    monkeypatch.setattr("precision_audit.loading.resolve_loss", lambda source, out, batch: lambda o, b: o.sum())
    got = unused.unused_parameters(model, source, batch, "cpu", raised=lambda e: (_ for _ in ()).throw(e))
    assert got == []
    stranger = torch.zeros(1, requires_grad=True)
    monkeypatch.setattr(unused, "reached_parameters", lambda loss: unused.Reached({id(stranger)}, set()))
    assert unused.unused_parameters(model, source, batch, "cpu", raised=lambda e: (_ for _ in ()).throw(e)) is None


def test_an_unused_head_audits_across_ranks_as_in_one_process(tmp_path):
    src = tmp_path / "model.py"
    src.write_text(UNUSED_HEAD)
    a, b = _compare(str(src), tmp_path)
    assert b["distributed"]["parallelism"] == ("DistributedDataParallel (2 parameter(s) no loss reaches left out "
                                               "of its reduction: pooler.weight, pooler.bias)")
    decided = [(p["default_format"], p["overrides"], [c["label"] for c in p["candidates"] if c["chosen"]])
               for p in (a["plan"], b["plan"])]
    assert decided[0] == decided[1] and decided[1][0] != "fp32", decided
    assert "Expected to have finished reduction" not in json.dumps(b)


def test_a_parameter_used_in_training_only_is_reduced(tmp_path):
    """The forward that finds unused parameters runs in the model's own (training) mode, as the passes do: 'aux'
    is used there and reduced; a forward in eval mode would leave it out of DDP's sums, and its gradients would be
    each rank's own (the figures below would differ from one process's)."""
    src = tmp_path / "model.py"
    src.write_text(TRAINING_ONLY)
    _, b = _compare(str(src), tmp_path)
    assert b["distributed"]["parallelism"] == "DistributedDataParallel"


def test_a_parameter_only_some_ranks_use_is_refused_by_name(tmp_path):
    src = tmp_path / "model.py"
    src.write_text(SOME_RANKS)
    out = tmp_path / "out"
    r = audit(str(src), "--out", str(out), "--nproc", "2", timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "parameter 'extra.bias' gets no gradient from rank 1's share of the batch but does from rank 0's" \
        in r.stderr, r.stderr[-2000:]
    assert "--shard fsdp" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()
