"""Architectures nobody on this project wrote: Hugging Face transformers models, audited end to end.

Each model is built from a small config with random weights (nothing is downloaded: no ``from_pretrained``,
``HF_HUB_OFFLINE=1``), written as a ``model.py`` with ``build_model()``, given a batch dict of ``input_ids`` /
``attention_mask`` / ``labels`` (``pixel_values`` / ``labels`` for ViT) saved with ``torch.save``, and audited
with ``steps=0``. The loss is the one the model returns (``output.loss``).

transformers is a test-only dependency (the ``test`` extra); without it this file is skipped.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
import torch

# Set before transformers (and huggingface_hub) are imported: they read it once, at import.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[test])")

from conftest import layer  # noqa: E402
from precision_audit.audit import AuditOptions, run_audit  # noqa: E402

BATCH, SEQ = 2, 16

# name -> (config class, model class, config kwargs, batch kind, vocabulary or number of labels)
MODELS: dict[str, tuple[str, str, dict, str, int]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=50257, n_layer=2, n_embd=64, n_head=4, n_positions=64), "causal", 50257),
    "bert": ("BertConfig", "BertForMaskedLM",
             dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  max_position_embeddings=64), "masked", 1000),
    "t5": ("T5Config", "T5ForConditionalGeneration",
           dict(vocab_size=1000, d_model=64, d_ff=128, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=4,
                decoder_start_token_id=0, pad_token_id=0), "seq2seq", 1000),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64), "causal", 32000),
    "vit": ("ViTConfig", "ViTForImageClassification",
            dict(image_size=16, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
                 num_attention_heads=4, intermediate_size=128, num_labels=10), "image", 10),
}

MODEL_PY = '''\
import torch
from transformers import {config_cls}, {model_cls}

CONFIG = {config!r}


def build_model():
    torch.manual_seed(0)
    return {model_cls}({config_cls}(**CONFIG))
'''


def _batch(kind: str, size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if kind == "image":
        return {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g),
                "labels": torch.randint(0, size, (BATCH,), generator=g)}
    ids = torch.randint(1, size, (BATCH, SEQ), generator=g)  # 0 is T5's pad / decoder start token
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # one padded sequence: the attention masks take part
    labels = ids.clone()
    if kind == "masked":
        labels[:, ::2] = -100  # loss on every other token, as a masked-LM batch has it
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class HFAudits:
    """Audits each model once per session; the tests below read the results."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self._cache: dict[str, tuple] = {}

    def get(self, name: str):
        if name not in self._cache:
            config_cls, model_cls, config, kind, size = MODELS[name]
            d = self.base / name
            d.mkdir()
            (d / "model.py").write_text(MODEL_PY.format(config_cls=config_cls, model_cls=model_cls, config=config))
            torch.save(_batch(kind, size), d / "batch.pt")
            result = run_audit(AuditOptions(model=str(d / "model.py"), batch=str(d / "batch.pt"), out=d / "out",
                                            steps=0))
            self._cache[name] = (result, json.loads((d / "out" / "audit.json").read_text()),
                                 json.loads((d / "out" / "policy.json").read_text()))
        return self._cache[name]


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> HFAudits:
    return HFAudits(tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize("name", list(MODELS))
def test_audits_end_to_end_with_the_models_own_loss(hf, name):
    result, audit, policy = hf.get(name)
    assert result.exit_code == 0, audit["verdict"]
    assert audit["model"]["class"] == MODELS[name][1]
    assert audit["loss"]["kind"] == "output.loss"
    assert audit["formats"] == ["fp16", "bf16"]
    assert audit["model"]["training"] is True, "a freshly built HF model is in train mode and is audited as given"
    layers = audit["layers"]
    assert layers[0]["name"] == "" and len(layers) > 10
    assert all(L["calls"] >= 1 for L in layers), [L["name"] for L in layers if L["calls"] < 1]
    for f in ("fp16", "bf16"):
        s = audit["summary"][f]
        assert s["pass_error"] is None, s["pass_error"]
        assert s["nonfinite"]["outputs"] == s["nonfinite"]["param_grads"] == 0, f"{name} {f}: {s['nonfinite']}"
        assert 0 < s["output"]["rel_l2"] < 0.05, f"{name} {f}: output error {s['output']['rel_l2']}"
        assert s["loss_rel_change"] < 0.01, f"{name} {f}: loss change {s['loss_rel_change']}"
    # Every module that computes was re-run alone in each format (a KV cache must not get in the way), except
    # containers whose own work is a residual add (docs/memory.md, "Local re-runs").
    unmeasured = [(L["name"], f, L["error"][f]["local_note"]) for L in layers if L["computes"] and L["name"]
                  for f in ("fp16", "bf16") if L["error"][f]["local"] is None
                  and not (L["error"][f]["local_note"] or "").startswith("not re-run: container")]
    assert not unmeasured, unmeasured
    assert not any("different output structures" in w for w in audit["warnings"])
    assert policy["model"]["class"] == MODELS[name][1] and policy["default_format"] == "bf16"


def _misaligned(audit: dict, name: str, fmt: str) -> dict[str, dict]:
    return {d["dim"]: d for finding in layer(audit, name)["alignment"] for d in finding["dims"]
            if d["format"] == fmt and not d["aligned"]}


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_gpt2_lm_head_vocabulary_is_flagged_for_padding(hf, fmt):
    _, audit, _ = hf.get("gpt2")
    n = _misaligned(audit, "lm_head", fmt)["N"]
    assert n["size"] == 50257 and n["required_multiple"] == 8
    assert n["suggested_size"] == 50264, "the next multiple of 8"
    assert n["efficient_size"] == 50304, "the next multiple of 64, as nanoGPT pads GPT-2's vocabulary"
    (wte,) = layer(audit, "transformer.wte")["alignment"]
    assert wte["dims"][0]["size"] == 50257 and "50304" in wte["vocabulary_advice"]


def test_gpt2_tied_embedding_and_head_get_the_same_format(hf):
    _, audit, policy = hf.get("gpt2")
    assert layer(audit, "lm_head")["plan"]["format"] == layer(audit, "transformer.wte")["plan"]["format"]
    assert "lm_head" not in policy["modules"] or (policy["modules"]["lm_head"]["format"]
                                                   == policy["modules"].get("transformer.wte", {}).get("format"))


def test_llama_vocabulary_of_32000_needs_no_padding(hf):
    _, audit, _ = hf.get("llama")
    assert "N" not in _misaligned(audit, "lm_head", "bf16"), "32000 is a multiple of 64"


def test_vit_classifier_with_10_labels_is_flagged(hf):
    _, audit, _ = hf.get("vit")
    n = _misaligned(audit, "classifier", "bf16")["N"]
    assert (n["size"], n["suggested_size"]) == (10, 16)


def test_t5_in_fp16_at_random_init(hf):
    """What the audit says about T5 in fp16: with random weights it is safe as is (the overflow T5 is known for
    in fp16 comes from trained weights, whose feed-forward activations exceed 65504)."""
    _, audit, _ = hf.get("t5")
    s = audit["summary"]["fp16"]
    assert s["safe"] and s["loss_scale"] > 1, s["verdict"]
    amax = max(L["activation"]["amax"] for L in audit["layers"] if L["activation"]["amax"] is not None)
    assert amax < 65504 / 16, f"random-init T5 keeps 4 bits of fp16 headroom; largest activation {amax}"
    assert audit["loss_scale"]["recommended_init_scale"] == s["loss_scale"]
    # the decoder's self-attention (which takes a KV cache when use_cache is on) is measured like the rest
    sa = layer(audit, "decoder.block.0.layer.0.SelfAttention")
    assert sa["error"]["fp16"]["local"]["rel_l2"] < 0.01
    assert sa["plan"]["format"] != "fp32", sa["plan"]


def test_models_are_built_offline():
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    src = textwrap.dedent(MODEL_PY)
    assert "from_pretrained" not in src
