"""Robustness: the policy loader against arbitrary input, and audits of unusual model structures.

- the policy loader: arbitrary JSON-like values, arbitrary text, and mutations of a real policy raise nothing
  but :class:`PolicyError` (hypothesis);
- modules called twice or shared by two parents, a module that calls itself, a recursive tree of modules,
  weight tying;
- dropout and BatchNorm in train and in eval mode: the audit says which mode it used and leaves the user's
  model as it was;
- determinism: the same seed gives the same numbers.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import layer
from models import HEADER
from precision_audit.audit import AuditOptions, run_audit
from precision_audit.errors import PolicyError
from precision_audit.model_names import fingerprint, model_layout
from precision_audit.policy.io import load_policy, parse_policy
from precision_audit.policy.schema import LossScaling, ModuleOverride, Policy

# ---------------------------------------------------------------------------------------------------------------
# the policy loader
# ---------------------------------------------------------------------------------------------------------------

JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=25,
)


def _real_policy() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    fp, n = fingerprint(model)
    return Policy(model_class="Sequential", model_fingerprint=fp, model_modules=n, target_name="H100 SXM",
                  target_compute_capability=(9, 0), target_key="h100-sxm", default_format="bf16",
                  modules={"2": ModuleOverride("fp32", "local error 3e-2 > budget")},
                  loss_scaling=LossScaling(enabled=True, init_scale=1024.0), tf32_matmul=True, tf32_cudnn=True,
                  tool_version="0.1.0", model_layout=model_layout(model)).to_dict()


REAL = _real_policy()


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a nested dict/list (the root included)."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, prefix + (i,))
    return out


PATHS = _paths(REAL)


def _only_policy_error(fn, *args) -> Policy | None:
    try:
        return fn(*args)
    except PolicyError as e:
        assert e.exit_code == 2 and e.message.strip(), "a PolicyError carries a message"
        return None


def test_the_real_policy_loads_and_round_trips():
    policy = Policy.from_dict(copy.deepcopy(REAL))
    assert policy.to_dict() == REAL
    assert parse_policy(json.dumps(REAL)).to_dict() == REAL


@settings(max_examples=200, deadline=None)
@given(JSON_VALUES)
def test_from_dict_raises_only_policy_error_for_any_json_like_value(value):
    _only_policy_error(Policy.from_dict, value)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(REAL)), JSON_VALUES, max_size=len(REAL)))
def test_from_dict_raises_only_policy_error_for_wrong_values_under_real_keys(doc):
    _only_policy_error(Policy.from_dict, {**{"schema": REAL["schema"], "version": REAL["version"]}, **doc})


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_parse_policy_raises_only_policy_error_for_any_text(text):
    _only_policy_error(parse_policy, text)


@settings(max_examples=200, deadline=None)
@given(JSON_VALUES)
def test_parse_policy_raises_only_policy_error_for_any_json_document(value):
    _only_policy_error(parse_policy, json.dumps(value))  # NaN/Infinity included: json.dumps writes them


def _mutate(doc: dict, path: tuple, op: str, new: Any) -> dict:
    doc = copy.deepcopy(doc)
    if not path:
        return new if op == "replace" else doc
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if op == "drop":
        del parent[path[-1]]
    elif op == "replace":
        parent[path[-1]] = new
    elif op == "wrap":  # the right value, one level too deep
        parent[path[-1]] = [parent[path[-1]]]
    return doc


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PATHS), st.sampled_from(["drop", "replace", "wrap"]), JSON_VALUES)
def test_mutations_of_a_real_policy_load_or_raise_policy_error(path, op, new):
    doc = _mutate(REAL, path, op, new)
    policy = _only_policy_error(Policy.from_dict, doc)
    if policy is not None:  # accepted: then it must survive its own round trip
        assert Policy.from_dict(policy.to_dict()).to_dict() == policy.to_dict()
    _only_policy_error(parse_policy, json.dumps(doc))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200))
def test_load_policy_raises_only_policy_error_for_any_file(tmp_path, data):
    p = tmp_path / "policy.json"
    p.write_bytes(data)
    _only_policy_error(load_policy, p)


# ---------------------------------------------------------------------------------------------------------------
# audits of unusual structures
# ---------------------------------------------------------------------------------------------------------------



def audit(tmp_path: Path, body: str, batch: Any, name: str = "model.py", **options) -> tuple[Any, dict, dict]:
    """Write ``body`` as a model file and ``batch`` with torch.save, audit them (steps=0 unless given)."""
    d = tmp_path / Path(name).stem
    d.mkdir(exist_ok=True)
    (d / name).write_text(HEADER + textwrap.dedent(body))
    torch.save(batch, d / "batch.pt")
    spec = str(d / name) + (":" + options.pop("attribute") if "attribute" in options else "")
    options.setdefault("steps", 0)
    result = run_audit(AuditOptions(model=spec, batch=str(d / "batch.pt"), out=d / "out", **options))
    return (result, json.loads((d / "out" / "audit.json").read_text()),
            json.loads((d / "out" / "policy.json").read_text()))


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


SHARED = """
class Branch(nn.Module):
    def __init__(self, proj):
        super().__init__()
        self.proj = proj
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(self.proj(x))

class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        shared = nn.Linear(16, 16)
        self.twice = nn.Linear(16, 16)
        self.a = Branch(shared)
        self.b = Branch(shared)  # the same Linear under two parents

    def forward(self, x):
        x = self.twice(torch.relu(self.twice(x)))  # one module called twice
        return self.b(self.a(x))

def build_model():
    torch.manual_seed(0)
    return Shared()
"""


def test_a_module_called_twice_and_one_shared_by_two_parents(tmp_path):
    result, a, policy = audit(tmp_path, SHARED, _x(8, 16))
    assert result.exit_code == 0
    names = [L["name"] for L in a["layers"]]
    assert "b.proj" not in names, "named_modules() lists a shared module once, under its first name"
    for name in ("twice", "a.proj"):
        L = layer(a, name)
        assert L["calls"] == 2, f"{name}: {L['calls']} calls"
        for f in ("fp16", "bf16"):
            assert L["error"][f]["local"]["elements"] == 2 * 8 * 16, "both calls are measured"
            assert 0 < L["error"][f]["accumulated"]["rel_l2"] < 0.05
    assert layer(a, "b")["calls"] == 1 and layer(a, "b.norm")["calls"] == 1


SELF_CALLING = """
class Halver(nn.Module):
    \"\"\"Calls itself on a smaller input until one feature is left.\"\"\"

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        y = torch.tanh(self.fc(x))
        if x.shape[0] == 1:
            return y
        return y + self(y[: x.shape[0] // 2]).mean(0)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.halver = Halver()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.halver(x))

def build_model():
    torch.manual_seed(0)
    return Net()
"""


def test_a_module_that_calls_itself_on_a_smaller_input(tmp_path):
    result, a, _ = audit(tmp_path, SELF_CALLING, _x(8, 16))  # 8 -> 4 -> 2 -> 1: four calls
    assert result.exit_code == 0
    for name in ("halver", "halver.fc"):
        L = layer(a, name)
        assert L["calls"] == 4, f"{name}: {L['calls']} calls"
        assert L["output_shapes"] in ([[1, 16]], [[8, 16]]), "the first call to finish: innermost or outermost"
        for f in ("fp16", "bf16"):
            acc = L["error"][f]["accumulated"]
            assert acc["elements"] > 0 and acc["nonfinite"] == 0 and acc["rel_l2"] < 0.05
    # the recursion's calls are matched call by call in the format passes, nothing left unmatched
    assert a["summary"]["bf16"]["output"]["rel_l2"] < 0.05


TREE = """
class Node(nn.Module):
    \"\"\"A binary tree of modules: each node mixes its input and sums its two subtrees.\"\"\"

    def __init__(self, depth):
        super().__init__()
        self.mix = nn.Linear(8, 8)
        self.children_ = nn.ModuleList([Node(depth - 1), Node(depth - 1)]) if depth else nn.ModuleList()

    def forward(self, x):
        y = torch.relu(self.mix(x))
        for child in self.children_:
            y = y + child(y)
        return y

def build_model():
    torch.manual_seed(0)
    return Node(3)
"""


def test_a_recursive_tree_of_modules(tmp_path):
    result, a, policy = audit(tmp_path, TREE, _x(4, 8))
    assert result.exit_code == 0
    names = [L["name"] for L in a["layers"]]
    mixes = [n for n in names if n.endswith("mix") or n == "mix"]
    assert len(mixes) == 15, "1 + 2 + 4 + 8 nodes, each with its own Linear"
    assert "children_.1.children_.0.children_.1.mix" in names
    assert all(L["calls"] == 1 for L in a["layers"])
    deepest = layer(a, "children_.1.children_.1.children_.1.mix")
    assert deepest["depth"] == 7 and deepest["error"]["bf16"]["local"]["rel_l2"] < 0.05
    assert policy["model"]["modules"] == len(names) + 15, "every module, the 15 ModuleLists (no own run) too"


TIED = """
class TiedLM(nn.Module):
    def __init__(self, gain=1.0):
        super().__init__()
        self.wte = nn.Embedding(64, 16)
        self.mid = nn.Linear(16, 16)
        self.lm_head = nn.Linear(16, 64, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2 does
        with torch.no_grad():
            self.mid.weight.mul_(gain)

    def forward(self, ids):
        return self.lm_head(torch.relu(self.mid(self.wte(ids))))

def build_model():
    torch.manual_seed(0)
    return TiedLM()

def build_hot():
    # mid's gain pushes lm_head's logits past fp16's 65504: lm_head is kept out of fp16
    torch.manual_seed(0)
    return TiedLM(gain=20000.0)
"""


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    return ids, ids


def _same_format_for_tied(a: dict, policy: dict) -> None:
    wte, head = layer(a, "wte")["plan"]["format"], layer(a, "lm_head")["plan"]["format"]
    assert wte == head, f"tied modules planned apart: wte {wte}, lm_head {head}"
    fmt = lambda n: policy["modules"].get(n, {}).get("format", policy["default_format"])  # noqa: E731
    assert fmt("wte") == fmt("lm_head"), policy["modules"]


def test_weight_tying_audits_and_both_modules_get_one_format(tmp_path):
    result, a, policy = audit(tmp_path, TIED, _ids())
    assert result.exit_code == 0
    assert a["model"]["parameters"] == 64 * 16 + 16 * 16 + 16, "the tied weight is counted once"
    _same_format_for_tied(a, policy)
    # the shared weight's gradient (both uses summed) is attributed once, to its first owner
    assert layer(a, "wte")["gradient"]["parameters"] is not None
    assert layer(a, "lm_head")["gradient"]["parameters"] is None


def test_weight_tying_with_a_pinned_head_keeps_both_in_one_format(tmp_path):
    result, a, policy = audit(tmp_path, TIED, _ids(), attribute="build_hot", target="v100")
    assert layer(a, "lm_head")["plan"]["format"] == "fp32", "the overflowing head is pinned"
    _same_format_for_tied(a, policy)


# ---------------------------------------------------------------------------------------------------------------
# a forward with a key/value cache
# ---------------------------------------------------------------------------------------------------------------

CACHED = """
class Cache:
    \"\"\"A stand-in for Hugging Face's DynamicCache: keys appended in place at every call.\"\"\"

    def __init__(self):
        self.keys = []

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.k = nn.Linear(8, 8)
        self.q = nn.Linear(8, 8)

    def forward(self, x, cache=None):
        k = self.k(x)
        position = 0
        if cache is not None:
            position = len(cache.keys)  # as rotary positions start after the cached tokens
            cache.keys.append(k)
        return torch.softmax(self.q(x) @ k.T, dim=-1) @ k * (1 + position)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()
        self.head = nn.Linear(8, 4)

    def forward(self, x, use_cache=True):
        return self.head(self.attn(x, Cache() if use_cache else None))

def build_model():
    torch.manual_seed(0)
    return Net()
"""


def test_a_forward_with_use_cache_is_audited_without_the_cache(tmp_path):
    """The per-module re-runs reuse the call's arguments; a cache the call appended to would give them other
    inputs (attention over duplicated keys, or another output shape), so the audit passes use_cache=False."""
    from precision_audit.loading import load_batch, load_model

    _, a, _ = audit(tmp_path, CACHED, _x(4, 8))
    for f in ("fp16", "bf16"):
        local = layer(a, "attn")["error"][f]["local"]
        assert local["elements"] == 4 * 8 and local["rel_l2"] < 0.01, local
    model, source = load_model(str(tmp_path / "model" / "model.py"))
    batch = load_batch(str(tmp_path / "model" / "batch.pt"), model, source)
    assert batch.kwargs == {"use_cache": False} and "use_cache=False" in batch.notes[0]
    torch.save({"x": _x(4, 8), "use_cache": True}, tmp_path / "kw.pt")
    assert load_batch(str(tmp_path / "kw.pt"), model, source).kwargs["use_cache"] is True, "the batch's own wins"
    assert load_batch(str(tmp_path / "kw.pt"), model, source).notes == ()


def test_a_cache_the_batch_asks_for_does_not_leak_into_the_re_runs(tmp_path):
    _, a, _ = audit(tmp_path, CACHED, {"x": _x(4, 8), "use_cache": True})
    local = layer(a, "attn")["error"]["bf16"]["local"]
    assert local["rel_l2"] < 0.01, local


# ---------------------------------------------------------------------------------------------------------------
# train / eval mode
# ---------------------------------------------------------------------------------------------------------------

MODES = """
import sys

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.bn(self.fc1(x)))))

torch.manual_seed(0)
model = Net()
with torch.no_grad():  # running statistics that differ from any batch's, so the two modes differ
    model.bn.running_mean.fill_(0.5)
    model.bn.running_var.fill_(4.0)
model.train({training})
"""


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_dropout_and_batchnorm_mode_is_reported_and_the_model_left_as_it_was(tmp_path, training):
    x = _x(32, 16)
    result, a, _ = audit(tmp_path, MODES.format(training=training), (x, torch.randint(0, 4, (32,))))
    assert result.exit_code == 0
    assert a["model"]["training"] is training
    note = a["model"]["mode_note"]
    if training:
        assert "train mode" in note and "dropout is active" in note and "batch statistics" in note
    else:
        assert "eval mode" in note and "dropout off" in note and "running statistics" in note
    # the user's own model object: same mode, same buffers (BatchNorm's running statistics), same weights
    (user,) = [m for m in sys.modules.values()
               if getattr(m, "__file__", None) == str((tmp_path / "model" / "model.py").resolve())]
    model = user.model
    assert model.training is training and model.bn.training is training and model.drop.training is training
    assert torch.equal(model.bn.running_mean, torch.full((32,), 0.5))
    assert torch.equal(model.bn.running_var, torch.full((32,), 4.0))
    assert int(model.bn.num_batches_tracked) == 0
    # dropout draws the same masks in every format: the outputs agree as in a dropout-free model
    for f in ("fp16", "bf16"):
        assert a["summary"][f]["output"]["rel_l2"] < 0.05, (f, a["summary"][f]["output"])
    # and the reference really ran in the mode it reports: eval uses the running statistics (loss differs)
    zeros = {n: layer(a, n)["activation"]["zeros"] / layer(a, n)["activation"]["elements"] for n in ("act", "drop")}
    if training:  # dropout zeroes about half of what ReLU lets through
        assert zeros["drop"] > zeros["act"] + 0.25 * (1 - zeros["act"]), zeros
    else:
        assert zeros["drop"] == zeros["act"], zeros


def test_train_and_eval_audits_differ(tmp_path):
    x = (_x(32, 16), torch.randint(0, 4, (32,)))
    _, train, _ = audit(tmp_path, MODES.format(training=True), x, name="train.py")
    _, evals, _ = audit(tmp_path, MODES.format(training=False), x, name="eval.py")
    assert train["summary"]["fp32"]["loss"] != evals["summary"]["fp32"]["loss"]


# ---------------------------------------------------------------------------------------------------------------
# determinism
# ---------------------------------------------------------------------------------------------------------------


def _numbers(a: dict) -> dict:
    """What must not change between two audits with the same seed: everything but timings and dates."""
    summary = {f: {k: v for k, v in s.items() if k != "step_time"} for f, s in a["summary"].items()}
    return {"layers": a["layers"], "summary": summary, "loss_scale": a["loss_scale"], "plan": a["plan"],
            "verdict": a["verdict"]}


def test_same_seed_gives_identical_numbers(tmp_path):
    batch = (_x(32, 16), torch.randint(0, 4, (32,)))
    body = MODES.format(training=True)  # dropout in train mode: the numbers depend on the seed
    _, first, p1 = audit(tmp_path, body, batch, name="first.py", seed=7)
    _, second, p2 = audit(tmp_path, body, batch, name="second.py", seed=7)
    _, other, _ = audit(tmp_path, body, batch, name="other.py", seed=8)
    assert _numbers(first) == _numbers(second)
    assert p1 == p2
    assert _numbers(first)["summary"] != _numbers(other)["summary"], "another seed draws other dropout masks"
    assert math.isfinite(first["summary"]["fp32"]["loss"])
