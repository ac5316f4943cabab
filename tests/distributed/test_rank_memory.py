"""Issue 15 item 4, the parts of a rank's memory bound that run in one process (the 2-rank audit itself is
tests/distributed/test_distributed_meta.py, slow): saved weight copies kept as recipes are made again bit for bit
(precision_audit/distributed/saved.py), and the allocator setting leaves a user's own alone (distributed/run.py)."""

from __future__ import annotations

import torch

from precision_audit.capture.memory import SavedTensorCounter
from precision_audit.distributed import run as rank_run
from precision_audit.distributed import saved


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def test_recipe_makes_each_kind_of_weight_copy_again_bit_for_bit():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32, 16) * 1e3)  # values that fp16 and bf16 round differently
    emulated = w.to(torch.float16).float()  # emulation.py's rounded fp32 copy
    cuda_like = w.to(torch.bfloat16).t()  # autocast's cast, saved as weight_cast.t() by a GEMM
    plain = w.to(torch.float16)
    for t in (emulated, cuda_like, plain):
        r = saved.recipe_of(t)
        assert r is not None
        again = r.make()
        assert again.shape == t.shape and again.stride() == t.stride() and again.dtype == t.dtype
        assert torch.equal(_bits(again), _bits(t))
    assert saved.recipe_of(w * 2) is None  # not a cast: an activation
    assert saved.recipe_of(torch.randn(4, 4)) is None
    assert saved.recipe_of(w.to(torch.float16).float() + 0) is None


def _step(counter_cls: type, model: torch.nn.Module, x: torch.Tensor) -> tuple:
    model.zero_grad()
    x = x.detach().requires_grad_(True)
    with counter_cls(model, lambda: None) as c:
        w = model.weight.to(torch.float16).float()
        y = torch.nn.functional.gelu(x @ w.t() + model.bias).pow(2).sum()
    y.backward()
    return x.grad, model.weight.grad, model.bias.grad, c.tally


def test_recomputing_counter_gives_the_same_gradients_and_counts(monkeypatch):
    made: list[int] = []
    real = saved.recipe_of
    monkeypatch.setattr(saved, "recipe_of", lambda t: (r := real(t)) is not None and made.append(1) or r)
    torch.manual_seed(1)
    model = torch.nn.Linear(48, 24)
    x = torch.randn(6, 48)
    a = _step(SavedTensorCounter, model, x)
    b = _step(saved.RecomputingCounter, model, x)
    assert made, "no saved weight copy was replaced by a recipe"
    for u, v in zip(a[:3], b[:3]):
        assert torch.equal(u, v)
    assert (a[3].activation_bytes, a[3].weight_copy_bytes, a[3].tensors) == \
        (b[3].activation_bytes, b[3].weight_copy_bytes, b[3].tensors)
    assert saved.RecomputingCounter.active is None


def test_a_users_allocator_threshold_is_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert rank_run._return_freed_memory() is False
