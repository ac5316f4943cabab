"""Reentrant activation checkpointing during the audit (capture/checkpointing.py): every module inside a
checkpointed segment gets the figures it gets without checkpointing (the independent reference: the same model
and batch, checkpointing off). Before, the modules inside a reentrant segment had no gradient ranges and no loss
impact."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as ckpt

from precision_audit.capture.session import CaptureConfig, CaptureSession
from precision_audit.formats import Format

FORMATS = (Format.FP16, Format.BF16)


def _figures(model: torch.nn.Module, forward, loss_of) -> dict:
    with CaptureSession(model, forward, loss_of, CaptureConfig(FORMATS)) as s:
        s.reference_run()
        for f in FORMATS:
            s.format_run(f)
        res = s.result()
    return {r.name: (r.grad_output.counts.tolist(), r.grad_param.counts.tolist(),
                     {f.value: (fs.local.rel_l2 if fs.local else fs.local_note, fs.accumulated.rel_l2,
                                fs.loss_impact, fs.impact_measured, fs.grad_output.amax)
                      for f, fs in r.formats.items()}) for r in res.layers}


@pytest.mark.parametrize("reentrant", [True, False])
def test_hugging_face_gradient_checkpointing_changes_no_figure(reentrant):
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))

    def figures(checkpointing: bool) -> dict:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=4, vocab_size=100)
        model = transformers.LlamaForCausalLM(cfg).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return _figures(model, lambda m: m(input_ids=ids, labels=ids, use_cache=False), lambda o: o.loss)

    plain, checkpointed = figures(False), figures(True)
    assert checkpointed == plain
    inner = plain["model.layers.0.mlp.down_proj"][2]
    assert all(v[3] and v[4] > 0 for v in inner.values())  # measured impacts and gradients inside the segment


class _Segment(torch.nn.Module):
    def __init__(self, frozen_input: bool) -> None:
        super().__init__()
        self.emb, self.block, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
        self.frozen_input = frozen_input

    def forward(self, ids):
        h = self.emb(ids)
        if self.frozen_input:
            h = h.detach()
        return self.head(ckpt.checkpoint(self.block, h, use_reentrant=True))


def test_a_segment_whose_inputs_need_no_grad_stays_reentrant_as_in_training():
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    model = _Segment(frozen_input=True)
    with pytest.warns(UserWarning, match="requires_grad"):
        model(ids).sum().backward()
    assert model.block.weight.grad is None  # training: no gradient reaches the segment's parameters
    model.zero_grad(set_to_none=True)
    original = ckpt.CheckpointFunction
    with pytest.warns(UserWarning, match="requires_grad"):
        got = _figures(model, lambda m: m(ids), lambda y: y.pow(2).mean())
    assert ckpt.CheckpointFunction is original  # put back
    assert got["block"][1] == [0] * len(got["block"][1])  # no parameter gradient counted, as in training


def test_a_reentrant_function_of_a_library_of_its_own_is_reported():
    library_reentrant = ckpt.CheckpointFunction  # as DeepSpeed's or Megatron's own: not torch's checkpoint()

    class Model(_Segment):
        def forward(self, ids):
            return self.head(library_reentrant.apply(self.block, True, self.emb(ids)))

    torch.manual_seed(0)
    model, ids = Model(False), torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(2))
    with CaptureSession(model, lambda m: m(ids), lambda y: y.pow(2).mean(), CaptureConfig(FORMATS)) as s:
        s.reference_run()
        warnings = s.result().warnings
    assert sum("reentrant autograd function" in w for w in warnings) == 1, warnings
