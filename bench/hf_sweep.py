"""More Hugging Face architectures, audited end to end by the CLI as a new user would: does each audit finish, and
is what it says true?

    python bench/hf_sweep.py [--models clip,distilbert,...] [--json out.json]

Each model is built from transformers' default configuration with random weights (nothing is downloaded), except
where the default is too large for a 2-core machine (BLOOM, DeBERTa-v2, Mixtral: sizes below), in train mode,
on a small batch with labels, and audited with ``precision-audit MODEL --batch SAMPLE`` (emulated, default
options). Per model it prints the exit code, the audit's wall time, each format's verdict, the FP16 loss scale
(and the scales at which the FP16 pass's own backward overflowed, when it did), the plan returned, and the
warnings that say the batch is degenerate. bench/real_models.py times eight other models; this script is about
correctness on more architectures, not cost. Results and what they found: bench/README.md, "More architectures".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_plans import MODEL_PY  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# name -> (config class, model class, config kwargs, batch kind, batch, sequence / image / audio size)
MODELS: dict[str, tuple[str, str, dict, str, int, int]] = {
    "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM", {}, "tokens", 2, 64),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", {}, "tokens", 1, 64),
    "opt": ("OPTConfig", "OPTForCausalLM", {}, "tokens", 1, 64),
    "electra": ("ElectraConfig", "ElectraForPreTraining", {}, "token_classes", 2, 64),
    "mobilebert": ("MobileBertConfig", "MobileBertForMaskedLM", {}, "tokens", 1, 64),
    "funnel": ("FunnelConfig", "FunnelForMaskedLM", {}, "tokens", 1, 64),
    "longformer": ("LongformerConfig", "LongformerForMaskedLM", {"attention_window": 32}, "tokens", 1, 128),
    "bloom": ("BloomConfig", "BloomForCausalLM", {"hidden_size": 512, "n_layer": 8, "n_head": 8}, "tokens", 1, 64),
    "deberta_v2": ("DebertaV2Config", "DebertaV2ForMaskedLM",
                   {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6, "intermediate_size": 1536},
                   "tokens", 1, 64),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
                 "num_key_value_heads": 2, "num_local_experts": 4, "vocab_size": 8000}, "tokens", 1, 64),
    "swin": ("SwinConfig", "SwinForImageClassification", {}, "image", 1, 224),
    "dinov2": ("Dinov2Config", "Dinov2ForImageClassification", {}, "image", 1, 224),
    "vit_mae": ("ViTMAEConfig", "ViTMAEForPreTraining", {}, "pixels", 1, 224),
    "segformer": ("SegformerConfig", "SegformerForSemanticSegmentation", {}, "segmentation", 1, 256),
    "efficientnet": ("EfficientNetConfig", "EfficientNetForImageClassification", {}, "image", 2, 224),
    "mobilenet_v2": ("MobileNetV2Config", "MobileNetV2ForImageClassification", {}, "image", 2, 224),
    "regnet": ("RegNetConfig", "RegNetForImageClassification", {}, "image", 2, 224),
    "wav2vec2": ("Wav2Vec2Config", "Wav2Vec2ForCTC", {}, "audio", 1, 32000),
    "clip": ("CLIPConfig", "CLIPModel", {}, "image_text", 2, 224),
}


def _batch(kind: str, b: int, size: int, cfg) -> dict:
    g = torch.Generator().manual_seed(0)
    vocab = getattr(cfg, "vocab_size", None) or 1000
    if kind in ("tokens", "token_classes"):
        ids = torch.randint(5, vocab, (b, size), generator=g)
        labels = ids.clone() if kind == "tokens" else torch.randint(0, 2, (b, size), generator=g)
        return {"input_ids": ids, "labels": labels}
    if kind == "image":
        return {"pixel_values": torch.randn(b, 3, size, size, generator=g),
                "labels": torch.randint(0, cfg.num_labels, (b,), generator=g)}
    if kind == "pixels":  # a self-supervised model: its loss needs no labels
        return {"pixel_values": torch.randn(b, 3, size, size, generator=g)}
    if kind == "segmentation":
        return {"pixel_values": torch.randn(b, 3, size, size, generator=g),
                "labels": torch.randint(0, cfg.num_labels, (b, size, size), generator=g)}
    if kind == "audio":
        return {"input_values": torch.randn(b, size, generator=g),
                "labels": torch.randint(1, vocab, (b, 20), generator=g)}
    assert kind == "image_text"
    return {"input_ids": torch.randint(5, 1000, (b, 16), generator=g),
            "pixel_values": torch.randn(b, 3, size, size, generator=g), "return_loss": True}


def audit(name: str, work: Path) -> dict:
    import transformers

    cfg_cls, model_cls, kwargs, kind, b, size = MODELS[name]
    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.py").write_text(MODEL_PY.format(config_cls=cfg_cls, model_cls=model_cls, config=kwargs))
    torch.save(_batch(kind, b, size, getattr(transformers, cfg_cls)(**kwargs)), d / "sample.pt")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "precision_audit", str(d / "model.py"), "--batch", str(d / "sample.pt"),
                        "--out", str(d / "out"), "-q"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    row: dict = {"model": name, "exit": p.returncode, "wall_s": time.perf_counter() - t0}
    if p.returncode not in (0, 1):
        row["error"] = (p.stderr.strip().splitlines() or ["?"])[-1][:300]
        return row
    a = json.loads((d / "out" / "audit.json").read_text())
    ls = a.get("loss_scale") or {}
    row.update(params=a["model"]["parameters"],
               verdicts={f: s["verdict"] for f, s in a["summary"].items() if isinstance(s, dict) and "verdict" in s},
               loss_scale=ls.get("recommended_init_scale"), backward_overflow=ls.get("backward_overflow"),
               plan=a["plan"]["chosen"],
               degenerate=[w[:90] for w in a["warnings"] if w.startswith(("every gradient", "FP32 is not reprod"))])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            row = audit(name, Path(tmp))
            rows.append(row)
            if "error" in row:
                print(f"{name}: exit {row['exit']} after {row['wall_s']:.0f} s: {row['error']}", flush=True)
                continue
            bo = row["backward_overflow"]
            scale = (f"{row['loss_scale']:g}" if row["loss_scale"] else "none") + (
                f" (backward overflowed at {', '.join(f'{s:g}' for s in bo['scales'])})" if bo else "")
            print(f"{name}: {row['params'] / 1e6:.0f}M params, exit {row['exit']}, {row['wall_s']:.0f} s; "
                  + "; ".join(f"{f} {v.split(':')[0]}" for f, v in row["verdicts"].items())
                  + f"; fp16 loss scale {scale}; plan {row['plan']}"
                  + (f"; warns: {' | '.join(row['degenerate'])}" if row["degenerate"] else ""), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
