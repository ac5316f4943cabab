"""Sparse gradients (``nn.Embedding(sparse=True)``, common in recommendation models): the audit counts a sparse
tensor as the dense tensor it stands for, and an audit of a model with a sparse embedding measures what the same
model with a dense embedding measures (the independent reference: the dense gradient has the same values)."""

from __future__ import annotations

import json

import pytest
import torch

from precision_audit.capture import stats
from precision_audit.capture.stats import MagnitudeHistogram, stored_values
from precision_audit.cli import main


def _same_histogram(a: MagnitudeHistogram, b: MagnitudeHistogram) -> None:
    assert (a.total, a.zeros, a.nans, a.infs, a.amax) == (b.total, b.zeros, b.nans, b.infs, b.amax)
    assert torch.equal(a.counts, b.counts)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "python"])
def test_a_sparse_tensor_counts_as_its_dense_form(monkeypatch, fused):
    monkeypatch.setattr(stats, "FUSED", fused and stats.FUSED)
    g = torch.Generator().manual_seed(0)
    # repeated indices: the dense tensor holds their sum (1e-30 + 1e-30 is not subnormal in fp16's sense twice)
    idx = torch.tensor([[0, 3, 3, 7, 7, 7], [1, 2, 2, 0, 0, 0]])
    vals = torch.tensor([1e-30, 2.0, 3.0, float("inf"), 1.0, 70000.0])
    coo = torch.sparse_coo_tensor(idx, vals, (9, 4), check_invariants=True)
    dense = coo.to_dense()
    for x in (coo, dense.to_sparse_csr(), torch.randn(50, 8, generator=g).relu().to_sparse()):
        h_sparse, h_dense = MagnitudeHistogram(), MagnitudeHistogram()
        h_sparse.update(x)
        h_dense.update(x.to_dense())
        _same_histogram(h_sparse, h_dense)
    assert torch.equal(stored_values(coo), torch.tensor([1e-30, 5.0, float("inf")]))  # coalesced: 3 stored sums


MODEL = """
import torch, torch.nn as nn
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.emb = nn.Embedding(100, 32, sparse={sparse}); s.head = nn.Linear(32, 3)
    def forward(s, x):
        return s.head(s.emb(x).mean(1))
def build_model():
    torch.manual_seed(0); return M()
def sample_batch():
    return torch.randint(0, 30, (4, 12), generator=torch.Generator().manual_seed(0))  # repeated tokens
"""


def test_an_audit_of_a_sparse_embedding_measures_what_the_dense_one_does(tmp_path):
    audits = {}
    for sparse in (True, False):
        src = tmp_path / f"sparse_{sparse}.py"
        src.write_text(MODEL.format(sparse=sparse))
        out = tmp_path / f"out_{sparse}"
        assert main([str(src), "--out", str(out), "-q"]) == 0
        audits[sparse] = json.loads((out / "audit.json").read_text())
    layers = {s: {x["name"]: x for x in a["layers"]} for s, a in audits.items()}
    assert layers[True]["emb"]["gradient"]["parameters"]["amax"] > 0
    for name, layer in layers[False].items():
        for key in ("gradient", "error", "activation"):
            assert layers[True][name][key] == layer[key], (name, key)
    for key in ("loss_scale", "verdict", "summary"):
        assert audits[True][key] == audits[False][key], key


def test_non_finite_positions_of_sparse_gradients_pair_up_as_the_dense_ones_do():
    """Two sparse gradients of one parameter that store different rows (the same number of them): their non-finite
    elements are paired by position in the dense tensor, as the dense masks pair them (the brute-force reference),
    not by their order in storage. A hybrid COO tensor (sparse rows of dense vectors), as nn.Embedding gives."""
    from precision_audit.capture.stats import count_nonfinite_pairs, nonfinite_where

    inf, nan = float("inf"), float("nan")
    ref = torch.sparse_coo_tensor(torch.tensor([[1, 4, 6]]), torch.tensor(
        [[1.0, inf], [2.0, 3.0], [nan, 1.0]]), (8, 2), check_invariants=True)
    fmt = torch.sparse_coo_tensor(torch.tensor([[4, 6, 7]]), torch.tensor(
        [[inf, 1.0], [nan, nan], [1.0, 1.0]]), (8, 2), check_invariants=True)
    dense_ref, dense_fmt = (~torch.isfinite(t.to_dense()) for t in (ref, fmt))
    expected = (int((dense_fmt & ~dense_ref).sum()), int((dense_fmt & dense_ref).sum()))
    assert expected == (2, 1)  # (4, 0) and (6, 1) are the format's own; (6, 0) is FP32's too
    assert count_nonfinite_pairs(nonfinite_where(fmt), nonfinite_where(ref)) == expected
    assert torch.equal(nonfinite_where(fmt), dense_fmt.flatten().nonzero().flatten())
    assert count_nonfinite_pairs(nonfinite_where(fmt.to_dense()), nonfinite_where(ref.to_dense())) == expected
    assert count_nonfinite_pairs(nonfinite_where(fmt), None) == (3, 0)
