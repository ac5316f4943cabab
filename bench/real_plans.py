"""Plans on real architectures: the plan against each uniform format, on models a new user would audit first.

    python bench/real_plans.py [--models resnet50,vit,gpt2,bert,t5,llama] [--threads N] [--json out.json]

Models are built from transformers' default configurations with random weights (nothing is downloaded:
``HF_HUB_OFFLINE=1``, no ``from_pretrained``): ResNet-50 (``ResNetConfig()``), ViT-B/16 (``ViTConfig()``), GPT-2
124M (``GPT2Config()``), BERT-base (``BertConfig()``), T5-small (``T5Config()``) and a Llama-style decoder with
GPT-2's width and depth (``LlamaConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
num_attention_heads=12)``), each in train mode as built, on a small batch (below), audited in emulated mode with
``--steps 0`` and the default budget. Batches (small: the audit runs every pass on the CPU): ResNet-50 2 images
of 224x224, ViT-B/16 1 image of 224x224, T5-small 2 sequences of 64 tokens, the others 1 sequence of 64 tokens
(relative loss change 1e-2, output error 5e-2).

Per model it prints each uniform format's measured loss change (the range over the two reduction orders the audit
measures) and estimated step time on the target, then the plan returned: its verified loss change, estimated step
time and override count, and its predicted (calibrated first-order) against its verified loss change. The checks
of issue 12: the plan is within budget, its estimated time is no worse than the fastest uniform format within
budget, and predicted and verified agree within 2x or the plan says which it trusts. Not a test: it takes many
minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name -> (config class, model class, config kwargs, batch kind, batch, sequence or image size)
MODELS: dict[str, tuple[str, str, dict, str, int, int]] = {
    "resnet50": ("ResNetConfig", "ResNetForImageClassification", {}, "image", 2, 224),
    "vit": ("ViTConfig", "ViTForImageClassification", {}, "image", 1, 224),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}, "causal", 1, 64),
    "bert": ("BertConfig", "BertForMaskedLM", {}, "masked", 1, 64),
    "t5": ("T5Config", "T5ForConditionalGeneration", {"decoder_start_token_id": 0}, "seq2seq", 2, 64),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                   num_key_value_heads=12), "causal", 1, 64),
}

MODEL_PY = '''\
import torch
from transformers import {config_cls}, {model_cls}

CONFIG = {config!r}


def build_model():
    torch.manual_seed(0)
    return {model_cls}({config_cls}(**CONFIG))
'''


def _batch(kind: str, batch: int, size: int, vocab: int, labels: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if kind == "image":
        return {"pixel_values": torch.randn(batch, 3, size, size, generator=g),
                "labels": torch.randint(0, labels, (batch,), generator=g)}
    ids = torch.randint(1, vocab, (batch, size), generator=g)
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    if kind == "masked":
        out["labels"][:, ::2] = -100
    return out


# --large: the sizes issue 12 reported from (ResNet-50 4 x 224², ViT-B/16 2 x 224², sequences 2 x 128).
LARGE = {"resnet50": (4, 224), "vit": (2, 224), "gpt2": (2, 128), "bert": (2, 128), "t5": (2, 64), "llama": (2, 128)}


def audit(name: str, work: Path, large: bool = False):
    import transformers

    from precision_audit.audit import AuditOptions, compute_audit

    cfg_cls, model_cls, kwargs, kind, batch, size = MODELS[name]
    if large:
        batch, size = LARGE[name]
    cfg = getattr(transformers, cfg_cls)(**kwargs)
    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.py").write_text(MODEL_PY.format(config_cls=cfg_cls, model_cls=model_cls, config=kwargs))
    vocab = getattr(cfg, "vocab_size", 0) or 0
    torch.save(_batch(kind, batch, size, vocab, getattr(cfg, "num_labels", 2)), d / "sample.pt")
    t0 = time.perf_counter()
    c = compute_audit(AuditOptions(model=str(d / "model.py"), batch=str(d / "sample.pt"), out=d / "out", steps=0))
    return c.audit, time.perf_counter() - t0


def fnum(x) -> str:
    return "—" if x is None else f"{x:.2e}"


def fus(t) -> str:
    return "—" if t is None else f"{t * 1e3:.3f} ms"


def report(name: str, a: dict, wall: float) -> dict:
    plan = a["plan"]
    budget = a["options"]["budget"]["max_loss_rel_change"]
    cands = plan["candidates"]
    print(f"\n== {name}: {a['model']['class']}, {a['model']['parameters']:,} parameters, batch "
          f"{' x '.join(str(s) for s in a['batch']['tensors'][0]['shape']) if a['batch']['tensors'] else '?'}, "
          f"audit {wall:.0f} s, noise floor (fp32 loss, {a['noise_floor']['threads'] if a['noise_floor'] else '—'} "
          f"threads): {fnum((a['noise_floor'] or {}).get('fp32_loss_rel'))}")
    print(f"  {'candidate':<14} {'loss change (2 orders)':>24} {'output err':>11} {'est. step':>11} {'overr.':>6} "
          f"{'within':>6}  note")
    for c in cands:
        rng = c["loss_rel_change_range"]
        lc = (f"{rng[0]:.2e}–{rng[1]:.2e}" if rng and rng[0] != rng[1] else fnum(c["loss_rel_change"]))
        print(f"  {c['label'] + (' *' if c['chosen'] else ''):<14} {lc:>24} {fnum(c['output_rel_error']):>11} "
              f"{fus(c['estimated_step_time_s']):>11} {c['overrides']:>6} {str(c['within_budget']):>6}  {c['note']}")
    ver = plan["verification"]
    pred = plan["predicted_loss_rel_change"]
    fastest = min((c["estimated_step_time_s"] for c in cands if c["label"].startswith("uniform") and
                   c["within_budget"]), default=None)
    within = bool(ver["within_budget"])
    no_worse = fastest is not None and plan["estimated_step_time_s"] <= fastest * (1 + 1e-9)
    p = plan["prediction"]
    print(f"  plan: {plan['chosen']} (default {plan['default_format']}, {len(plan['overrides'])} override(s)"
          f"{': ' + plan['override_counts'] if plan['overrides'] else ''}); verified {fnum(ver['loss_rel_change'])} "
          f"(budget {budget:g}), est. {fus(plan['estimated_step_time_s'])}; predicted {fnum(pred)} "
          f"(uncalibrated first-order {fnum(plan['first_order_loss_rel_change'])}); {p['note']}")
    for f, cal in (plan.get("calibration") or {}).items():
        print(f"  calibration {f}: x{cal['factor']:.3g} (measured {fnum(cal['measured_loss_rel_change'])}, "
              f"first-order sum {fnum(cal['first_order_sum_rel'])}){' — ' + cal['note'] if cal['note'] else ''}")
    for n, o in list(plan["overrides"].items())[:6]:
        print(f"    {n} -> {o['format']}: {o['reason']}")
    print(f"  checks: within budget {within}; no slower than the fastest uniform within budget {no_worse}; "
          f"predicted vs verified {'within 2x' if p['agree'] else 'explained: ' + p['trusted'] + ' trusted'}")
    return {"model": name, "chosen": plan["chosen"], "within_budget": within, "no_worse": no_worse,
            "verified": ver["loss_rel_change"], "predicted": pred,
            "estimated_step_time_s": plan["estimated_step_time_s"],
            "overrides": len(plan["overrides"]), "uniform": {c["label"]: [c["loss_rel_change"],
                                                                        c["estimated_step_time_s"]] for c in cands},
            "agree": p["agree"], "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before the audits")
    ap.add_argument("--json", default=None, help="also write the per-model results here")
    ap.add_argument("--large", action="store_true", help="the batch sizes issue 12 was reported with (slower)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); default budget; emulated mode, --steps 0")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            a, wall = audit(name, Path(tmp), args.large)
            if args.json:  # the plan as audited, kept whatever the printing below does
                Path(args.json).with_suffix(f".{name}.plan.json").write_text(
                    json.dumps({"plan": a["plan"], "summary": a["summary"], "noise_floor": a["noise_floor"],
                                "verdict": a["verdict"], "wall_s": wall}, indent=1) + "\n")
            try:
                rows.append(report(name, a, wall))
            except Exception:  # a printing bug must not cost the other models' audits
                import traceback

                traceback.print_exc()
            sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
