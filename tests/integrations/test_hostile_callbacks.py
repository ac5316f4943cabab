"""The trainer callbacks in a failing or unusual training run (issue 32, "Live contexts"; part of the hostile
catalogue with tests/cli/test_hostile_*.py): nothing the callback does stays behind in the user's process.

- Hugging Face: a ``train()`` that fails before the first forward (the collator raises) leaves ``model.forward``
  as it was: ``torch.save(model)`` works and a retry with a new callback audits (before, the one-shot wrapper
  stayed on the model, pickling failed on it, and the retry's audit ran into the old wrapper's);
- a wrapper left by a failure inside the step (another callback's ``on_step_begin`` raising after the audit's)
  is put back by the next callback (``on_init_end``, before ``train()`` reads the forward's signature);
- Lightning: the callback audits a Hugging Face GPT-2 wrapped in a LightningModule, built from a config with
  ``use_cache`` at its default (True): its blocks get a ``DynamicCache`` object beside their tensors, which the
  local re-runs copied with ``copy.deepcopy`` and failed on (capture/call_args.py); a training run that fails
  after ``apply_policy`` takes the policy off the model (``on_exception``).
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the test extra has it)")
pytest.importorskip("accelerate", reason="Trainer needs accelerate (the test extra has it)")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from precision_audit.integrations.transformers import PrecisionAuditCallback  # noqa: E402

SEQ = torch.arange(3, 11) * 7 % 100


class _Same(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"input_ids": SEQ.clone(), "labels": SEQ.clone()}


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)  # no dropout: the loss of the first batch is known
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def _args(tmp_path) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, use_cpu=True,
                             report_to=[], save_strategy="no", disable_tqdm=True)


def _cb() -> PrecisionAuditCallback:
    return PrecisionAuditCallback(steps=0, formats="bf16", progress=False)


def _fails_to_collate(items):
    raise ValueError("the collator's own error")


class _FailsAtStepBegin(transformers.TrainerCallback):
    """A callback after the audit's whose on_step_begin raises: the step fails between the audit callback's
    on_step_begin and the model's forward."""

    def on_step_begin(self, args, state, control, **kwargs):
        raise RuntimeError("another callback's own error")


def _retry_audits(model, tmp_path) -> None:
    cb = _cb()
    Trainer(model=model, args=_args(tmp_path / "retry"), train_dataset=_Same(), callbacks=[cb]).train()
    assert cb.result is not None and cb.result.audit["summary"]["fp32"]["loss"] > 0
    assert "forward" not in model.__dict__


def test_hf_train_failing_in_the_collator_leaves_the_model_as_it_was(tmp_path):
    model = _gpt2()
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=_Same(), data_collator=_fails_to_collate,
                      callbacks=[_cb()])
    with pytest.raises(ValueError, match="the collator's own error"):
        trainer.train()
    assert "forward" not in model.__dict__, "the callback's forward wrapper stayed on the model"
    torch.save(model, io.BytesIO())  # a local wrapper function cannot be pickled
    _retry_audits(model, tmp_path)


def test_a_wrapper_left_inside_a_failed_step_is_put_back_by_the_next_callback(tmp_path):
    model = _gpt2()
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=_Same(),
                      callbacks=[_cb(), _FailsAtStepBegin()])
    with pytest.raises(RuntimeError, match="another callback's own error"):
        trainer.train()
    assert "forward" in model.__dict__  # the Trainer has no event for a failed step: the wrapper is still there
    _retry_audits(model, tmp_path)


# -- Lightning ---------------------------------------------------------------------------------------------

def _lightning():
    try:
        import lightning as L
    except ImportError as e:  # not installed, or installed against another torch
        pytest.skip(f"lightning does not import here ({e}); pip install 'precision-audit[lightning]'")
    return L


def _ids_loader():
    ids = torch.randint(0, 100, (16, 8), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, ids), batch_size=4)


def _lightning_gpt2(L, fail_at: int | None = None):
    class Wrapped(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _gpt2()

        def forward(self, input_ids):
            return self.model(input_ids=input_ids).logits

        def training_step(self, batch, i):
            if i == fail_at:
                raise RuntimeError("the training step's own error")
            x, y = batch
            return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Wrapped()


def _trainer(L, tmp_path, cb):
    return L.Trainer(max_steps=2, accelerator="cpu", default_root_dir=str(tmp_path), callbacks=[cb], logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _loss(out, batch):
    return nn.functional.cross_entropy(out.flatten(0, 1), batch[1].flatten())


def test_lightning_callback_audits_a_wrapped_hf_gpt2_with_its_cache_on(tmp_path):
    L = _lightning()
    from precision_audit.integrations.lightning import PrecisionAuditCallback as LightningCallback

    module = _lightning_gpt2(L)
    assert module.model.config.use_cache is True  # the default: every block gets a DynamicCache object
    batch = next(iter(_ids_loader()))
    with torch.no_grad():
        expected = float(_loss(module(batch[0]), batch))
    cb = LightningCallback(steps=0, formats="bf16", progress=False, loss_fn=_loss)
    _trainer(L, tmp_path, cb).fit(module, _ids_loader())
    audit = cb.result.audit
    assert audit["summary"]["fp32"]["loss"] == pytest.approx(expected, rel=1e-6)
    attn = next(layer for layer in audit["layers"] if layer["name"] == "model.transformer.h.0.attn")
    assert attn["error"]["bf16"]["local"]["rel_l2"] < 2e-2  # re-run alone with the cache as the call found it
    assert audit["summary"]["bf16"]["output"]["elements"] == 4 * 8 * 100


def test_lightning_failure_after_apply_policy_takes_the_policy_off(tmp_path):
    L = _lightning()
    from precision_audit.integrations.lightning import PrecisionAuditCallback as LightningCallback

    module = _lightning_gpt2(L, fail_at=1)
    cb = LightningCallback(apply_policy=True, steps=0, formats="bf16", progress=False, loss_fn=_loss)
    with pytest.raises(RuntimeError, match="the training step's own error"):
        _trainer(L, tmp_path, cb).fit(module, _ids_loader())
    assert cb.handle is not None and not cb.handle.active
    assert not [n for n, m in module.named_modules() if "forward" in m.__dict__]
    torch.save(module.model, io.BytesIO())
