"""The callbacks over a run (issue 36): ``watch=True`` records the trainer's steps, ``audit_every=K`` and each
checkpoint save re-audit the first batch into ``precision-audit/step-<N>/``, and ``watch.json`` lands beside them
for ``precision-audit report`` / ``diff``."""

from __future__ import annotations

import json

import pytest
import torch

from precision_audit.cli import main
from precision_audit.errors import OptionError

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the test extra has it)")
pytest.importorskip("accelerate", reason="Trainer needs accelerate (the test extra has it)")

from tests.integrations.test_integrations import _gpt2, _Same, lightning_mlp  # noqa: E402


def test_hf_callback_watches_and_reaudits_every_k_steps_and_at_saves(tmp_path, capsys):
    from transformers import Trainer, TrainingArguments

    from precision_audit.integrations.transformers import PrecisionAuditCallback

    cb = PrecisionAuditCallback(apply_policy=True, watch=True, watch_every=2, audit_every=2, steps=0,
                                formats="bf16", progress=False)
    model = _gpt2()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, use_cpu=True,
                             report_to=[], save_strategy="steps", save_steps=3, logging_steps=1, disable_tqdm=True,
                             seed=7)
    Trainer(model=model, args=args, train_dataset=_Same(), callbacks=[cb]).train()
    out = tmp_path / "precision-audit"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step-")) == ["step-2", "step-3", "step-4"]
    for n in (2, 3, 4):
        assert json.loads((out / f"step-{n}" / "audit.json").read_text())["schema"] == "precision-audit/audit"
    log = json.loads((out / "watch.json").read_text())
    assert log["schema"] == "precision-audit/watch" and log["readings"] == 2
    head = log["modules"]["lm_head"]
    assert head["step"] == [1, 3] and all(v > 0 for v in head["output"]) and head["formats"] == ["bf16"]
    assert not cb.handle.active and "forward" not in model.lm_head.__dict__
    capsys.readouterr()  # the Trainer's own printing
    assert main(["diff", str(out / "step-2"), str(out / "step-4"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["same_model"] is True


def test_callback_watch_options_are_checked_when_made():
    from precision_audit.integrations.transformers import PrecisionAuditCallback

    for kw in ({"watch": 1}, {"audit_every": -1}, {"watch": True, "watch_every": 0}, {"horizon": 0}):
        with pytest.raises(OptionError):
            PrecisionAuditCallback(**kw)


def test_lightning_callback_watches_and_reaudits(tmp_path):
    try:
        import lightning as L
    except ImportError as e:
        pytest.skip(f"lightning does not import here ({e}); pip install 'precision-audit[lightning]'")
    from precision_audit.integrations.lightning import PrecisionAuditCallback

    Module = lightning_mlp(L)
    torch.manual_seed(0)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    cb = PrecisionAuditCallback(apply_policy=True, watch=True, watch_every=1, audit_every=2, steps=0,
                                formats="bf16", progress=False)
    trainer = L.Trainer(max_steps=4, accelerator="cpu", default_root_dir=str(tmp_path), callbacks=[cb],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Module(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8))
    out = tmp_path / "precision-audit"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step-")) == ["step-2", "step-4"]
    log = json.loads((out / "watch.json").read_text())
    assert log["modules"]["net.2"]["step"] == [1, 2, 3, 4]
