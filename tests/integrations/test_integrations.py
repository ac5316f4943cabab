"""The trainer callbacks (README.md, "In a Trainer"): a real Hugging Face ``Trainer`` training a tiny GPT-2 on the
CPU, and a real Lightning ``Trainer`` (skipped, saying why, where ``lightning`` is not installed).

- the audit sees the first training batch before the first optimizer step: its FP32 loss is the untrained
  model's loss on that batch, computed here independently;
- training with the callback (apply_policy=False) ends with weights bit-identical to training without it;
- the outputs land in ``<output_dir>/precision-audit/``, the summary is logged;
- apply_policy=True: the modules run in the policy's formats from the first step on (forward hooks see their
  output dtypes), and the handle is removed at the end of training;
- the Trainer's bf16 flag is set aside for the audit (FP32 reference unchanged) and a conflict with the plan is
  reported.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the test extra has it)")
pytest.importorskip("accelerate", reason="Trainer needs accelerate (the test extra has it)")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from precision_audit.errors import OptionError  # noqa: E402
from precision_audit.integrations._common import apply_for_training  # noqa: E402
from precision_audit.integrations.transformers import PrecisionAuditCallback  # noqa: E402
from precision_audit.policy.schema import ModuleOverride  # noqa: E402


@pytest.fixture(autouse=True)
def _no_kernel_floor(monkeypatch):
    """The tiny GPT-2 here is launch-bound: at the cost model's per-kernel floor fp16 ties with fp32 and fp32 (no
    loss scaling) is returned (docs/report.md, "The cost model's floor"), and its GEMMs are too small for Tensor
    Cores to pay (K of 8 to 64 against the calibration's K_half of 290: docs/gpu.md). These tests are about the
    callbacks on an fp16 plan, so the floor and the ramp are off."""
    from precision_audit.analysis import cost

    monkeypatch.setattr(cost, "KERNEL_FLOOR_S", 0.0)
    monkeypatch.setattr(cost, "K_HALF_AT_BF16_PEAK", 0.0)

SEQ = torch.arange(3, 11) * 7 % 100  # every example the same 8 tokens: the first batch is known


class _Same(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"input_ids": SEQ.clone(), "labels": SEQ.clone()}


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, bos_token_id=0,
                     eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def _no_dropout(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def _train(tmp_path, callbacks=(), **args):
    model = _gpt2()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    targs = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, use_cpu=True,
                              report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, seed=7,
                              **args)
    trainer = Trainer(model=model, args=targs, train_dataset=_Same(), callbacks=list(callbacks))
    trainer.train()
    return trainer, model, initial


def test_hf_callback_audits_the_first_batch_and_leaves_training_unchanged(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="precision_audit.integrations")
    cb = PrecisionAuditCallback(steps=0, formats="bf16", progress=False)
    trainer, model, initial = _train(tmp_path / "with", [cb])
    _, plain, _ = _train(tmp_path / "without")

    assert trainer.state.global_step == 3
    assert any(not torch.equal(v, initial[k]) for k, v in model.state_dict().items()), "it did not train"
    for k, v in plain.state_dict().items():  # the audit changed neither the model nor the random state
        assert torch.equal(v, model.state_dict()[k]), k
    out = tmp_path / "with" / "precision-audit"
    assert sorted(p.name for p in out.iterdir()) == ["audit.json", "policy.json", "report.html", "tb"]
    audit = json.loads((out / "audit.json").read_text())
    assert audit == cb.result.audit
    # what the Trainer passes to forward: the collated batch, and the label count it normalises the loss by
    assert audit["batch"]["tensors"] == [{"name": "input_ids", "shape": [4, 8], "dtype": "int64"},
                                         {"name": "labels", "shape": [4, 8], "dtype": "int64"},
                                         {"name": "num_items_in_batch", "shape": [], "dtype": "float32"}]
    assert audit["loss"]["kind"] == "output.loss"
    assert audit["model"]["training"] is True
    assert "precision-audit on the first training batch" in caplog.text and "plan:" in caplog.text
    assert cb.handle is None and "forward" not in model.__dict__


def test_hf_callback_audit_loss_is_the_untrained_models_loss(tmp_path):
    """Without dropout the audit's FP32 loss equals, to float rounding, the untrained model's loss on the batch:
    the audit ran before the first optimizer step, on the batch the Trainer fed."""
    cb = PrecisionAuditCallback(steps=0, formats="fp16", progress=False)
    model = _no_dropout(_gpt2())
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    first_inputs = []
    model.register_forward_pre_hook(lambda m, a, kw: first_inputs.append(dict(kw)) if not first_inputs else None,
                                    with_kwargs=True)
    targs = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, use_cpu=True,
                              report_to=[], save_strategy="no", disable_tqdm=True, bf16=True)
    Trainer(model=model, args=targs, train_dataset=_Same(), callbacks=[cb]).train()
    fresh = _no_dropout(_gpt2())
    fresh.load_state_dict(initial)
    with torch.no_grad():
        expected = float(fresh(**first_inputs[0]).loss)  # the untrained weights on the Trainer's first inputs
    assert torch.equal(first_inputs[0]["input_ids"], SEQ.repeat(4, 1))
    # bf16=True: accelerate wraps the forward in bf16 autocast; the audit's reference must still be plain fp32
    assert cb.result.audit["summary"]["fp32"]["loss"] == pytest.approx(expected, rel=1e-6)
    assert cb.result.policy.default_format == "fp16"
    assert [n for n in cb.notes if "the trainer runs bf16" in n and "not as the plan says" in n], cb.notes
    assert not any("loss scaling" in n for n in cb.notes)  # the policy is not applied: its fp16 is not trained


def test_hf_callback_conflict_with_the_trainer_flag_is_reported_and_the_policy_wins(tmp_path):
    """bf16=True Trainer, a plan in fp16: both conflicts are reported, and with apply_policy the modules run in
    fp16 inside accelerate's bf16 autocast."""
    cb = PrecisionAuditCallback(apply_policy=True, steps=0, formats="fp16", progress=False)
    model = _gpt2()
    seen = []
    model.get_submodule("transformer.h.0.attn.c_attn").register_forward_hook(
        lambda m, i, o: seen.append(o.dtype) if cb.result else None)
    targs = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, use_cpu=True,
                              report_to=[], save_strategy="no", disable_tqdm=True, bf16=True)
    Trainer(model=model, args=targs, train_dataset=_Same(), callbacks=[cb]).train()
    assert cb.result.policy.default_format == "fp16"  # only fp16 was audited, and the tiny GPT-2 is safe in it
    assert any("the trainer runs bf16 (bf16=True, fp16=False)" in n and "win inside them" in n
               for n in cb.notes), cb.notes
    assert any("needs loss scaling" in n for n in cb.notes), cb.notes
    assert seen == [torch.float16, torch.float16]


def test_hf_callback_applies_the_policy(tmp_path):
    seen: dict[str, list[torch.dtype]] = {}
    cb = PrecisionAuditCallback(apply_policy=True, steps=0, formats="bf16", progress=False)

    class Record(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            for name in ("lm_head", "transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc"):
                # the audit runs on a copy that carries these hooks too: count only training forwards
                model.get_submodule(name).register_forward_hook(
                    lambda m, i, o, name=name: seen.setdefault(name, []).append(o.dtype) if cb.result else None)

    trainer, model, initial = _train(tmp_path, [cb, Record()])
    policy = cb.result.policy
    assert policy.default_format == "bf16"  # the tiny GPT-2 is safe in bf16 (H100 target by default)
    want = {n: getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}.get(
        policy.modules[n].format if n in policy.modules else "bf16", "float32")) for n in seen}
    for name, dtypes in seen.items():
        # every training forward, the first step's included, runs under the policy
        assert len(dtypes) == 3 and set(dtypes) == {want[name]}, (name, dtypes)
    assert trainer.state.global_step == 3 and all(torch.isfinite(v).all() for v in model.state_dict().values())
    assert cb.handle is not None and not cb.handle.active  # removed at the end of training
    with torch.no_grad():
        assert model(input_ids=SEQ[None]).logits.dtype == torch.float32


def test_training_policy_keeps_overrides_and_puts_the_default_on_the_rest():
    """A plan override (fp32) inside a bf16 default: the override module runs fp32, its siblings bf16."""
    from precision_audit.model_names import fingerprint, model_layout
    from precision_audit.policy import LossScaling, Policy

    model = _gpt2()
    fp, n = fingerprint(model)
    policy = Policy(model_class="GPT2LMHeadModel", model_fingerprint=fp, model_modules=n, target_name="H100 SXM",
                    target_compute_capability=(9, 0), target_key="h100", default_format="bf16",
                    modules={"transformer.h.1.mlp": ModuleOverride("fp32", "kept in fp32 by the plan")},
                    loss_scaling=LossScaling(enabled=False), tf32_matmul=True, tf32_cudnn=True,
                    model_layout=model_layout(model))
    dtypes = {}
    for name in ("transformer.h.1.mlp.c_fc", "transformer.h.1.attn.c_attn", "lm_head"):
        model.get_submodule(name).register_forward_hook(lambda m, i, o, name=name: dtypes.__setitem__(name, o.dtype))
    handle = apply_for_training(policy, model)
    try:
        model(input_ids=SEQ[None])
    finally:
        handle.remove()
    assert dtypes == {"transformer.h.1.mlp.c_fc": torch.float32, "transformer.h.1.attn.c_attn": torch.bfloat16,
                      "lm_head": torch.bfloat16}
    assert set(handle.policy.modules) == {"transformer", "lm_head", "transformer.h.1.mlp"}


def test_callback_refuses_unknown_arguments_when_made():
    with pytest.raises(OptionError, match="out"):
        PrecisionAuditCallback(out="x")
    with pytest.raises(OptionError, match="fromats"):
        PrecisionAuditCallback(fromats="bf16")
    with pytest.raises(OptionError, match="apply_policy"):
        PrecisionAuditCallback(apply_policy="yes")


# -- Lightning ---------------------------------------------------------------------------------------------

def lightning_mlp(L):
    """A LightningModule class: an 8-16-4 MLP trained with cross-entropy and SGD (the Lightning tests' model)."""

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, i):
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Module


def test_lightning_callback(tmp_path):
    try:
        import lightning as L
    except ImportError as e:  # not installed, or installed against another torch
        pytest.skip(f"lightning does not import here ({e}); pip install 'precision-audit[lightning]'")
    from precision_audit.integrations.lightning import PrecisionAuditCallback as LightningCallback

    Module = lightning_mlp(L)
    torch.manual_seed(0)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    module = Module()
    with torch.no_grad():
        expected = float(nn.functional.cross_entropy(module(x[:8]), y[:8]))
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    dtypes = []
    cb = LightningCallback(apply_policy=True, steps=0, formats="bf16", progress=False)
    module.net[2].register_forward_hook(lambda m, i, o: dtypes.append(o.dtype) if cb.result else None)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", default_root_dir=str(tmp_path), callbacks=[cb],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    trainer.fit(module, loader)
    assert trainer.global_step == 3
    assert any(not torch.equal(v, initial[k]) for k, v in module.state_dict().items())
    audit = json.loads((tmp_path / "precision-audit" / "audit.json").read_text())
    assert audit["loss"]["kind"] == "cross_entropy"
    assert audit["summary"]["fp32"]["loss"] == pytest.approx(expected, rel=1e-6)  # before any optimizer step
    assert cb.result.policy.default_format == "bf16" and dtypes == [torch.bfloat16] * 3
    assert not cb.handle.active
