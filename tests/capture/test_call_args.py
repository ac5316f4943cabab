"""Modules called with plain Python objects beside their tensors (issue 32: Hugging Face's ``Cache``, any config or
state object): the local re-runs copy the objects and share the tensors (precision_audit/capture/call_args.py).

Before, the re-run's ``copy.deepcopy`` of such a call's arguments copied the tensors too, and an activation (not a
graph leaf) refuses that: the audit stopped with exit 2, "the model raised RuntimeError in its FP32 forward pass
... check that the batch matches", for ``self.block(self.inp(x), Cache())``.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import precision_audit
from precision_audit.capture.call_args import copy_arguments


class Cache:
    """A cache object as Hugging Face's: the call appends to it; may hold tensors (activations) of its own."""

    def __init__(self, prev: torch.Tensor | None = None) -> None:
        self.items: list[torch.Tensor] = []
        self.prev = prev


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, cache):
        cache.items.append(x)
        # its output depends on the cache as the call found it: a re-run that saw the cache after the call (one
        # item more) would return twice the output, a local error of ~1
        y = torch.relu(self.fc(x)) * len(cache.items)
        return y if cache.prev is None else y + 0.5 * cache.prev


class Net(nn.Module):
    def __init__(self, prev: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.block, self.out = nn.Linear(8, 16), Block(), nn.Linear(16, 4)
        self.prev = prev

    def forward(self, x):
        h = self.inp(x)
        return self.out(self.block(h, Cache(torch.tanh(h) if self.prev else None)))


@pytest.mark.parametrize("prev", [False, True], ids=["empty-cache", "cache-holding-an-activation"])
def test_a_module_called_with_a_cache_object_is_audited(prev):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    result = precision_audit.audit(Net(prev), x, steps=0, progress=False)
    assert result.exit_code in (0, 1)
    block = next(layer for layer in result.audit["layers"] if layer["name"] == "block")
    for fmt in ("fp16", "bf16"):
        local = block["error"][fmt]["local"]
        assert local is not None, block["error"][fmt]
        # the re-run saw the cache as the call did: the rounding error of one format, not a doubled output
        assert local["rel_l2"] < 2e-2, (fmt, local)


def test_copy_arguments_copies_objects_and_shares_or_clones_tensors():
    w = nn.Linear(2, 2)
    a = torch.randn(3, requires_grad=True) * 2  # not a graph leaf: deepcopy refuses it
    cache = Cache(prev=a)
    cache.items.append(a)
    args, kwargs = (a, cache), {"module": w, "n": 3}
    shared = copy_arguments((args, kwargs), clone_tensors=False)
    assert shared is not None
    (a2, cache2), kw2 = shared
    assert a2 is a and cache2 is not cache and cache2.prev is a and cache2.items[0] is a
    assert cache2.items is not cache.items and kw2["module"] is w and kw2["n"] == 3
    cloned = copy_arguments((args, kwargs), clone_tensors=True)
    assert cloned is not None
    (a3, cache3), kw3 = cloned
    assert a3 is not a and torch.equal(a3, a) and not a3.requires_grad
    assert cache3.prev is a3 and cache3.items[0] is a3  # one clone per tensor, shared where the tensor was
    assert kw3["module"] is w


def test_arguments_that_cannot_be_copied_give_none():
    class Locked:
        def __init__(self) -> None:
            self.lock = threading.Lock()

    assert copy_arguments(((torch.zeros(1), Locked()), {}), clone_tensors=False) is None
