"""Watch false alarms (issue 36): train the bundled samples and two Hugging Face models (tiny configs, random
data) with ``controller(..., watch=True)`` for 300 steps under a uniform fp16 policy (the tightest range; the
fp16_trouble sample with its overflowing ``hot`` pinned to fp32, as its audit plans) and report every action and
every forecast that put a crossing within 5 horizons, with the measured trend behind it.

    python bench/watch_false_alarms.py [--steps 300] [--every 10] [--only mlp,cnn,...] [--measure-only]

``--measure-only`` never acts: it lists the forecasts that would have acted and what the series then did (whether
and when the limit was actually crossed), which tells a justified promotion from a false alarm.

Random data: each step draws a fresh batch shaped like the sample's (floating tensors ~ N(0, 1), integer tensors
uniform over the sample's value range). Adam, lr 1e-3, CPU autocast (emulated fp16 on the CPU), GradScaler from
2^16 (the policy default). Output: one line per model, then the forecasts and actions, if any.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import precision_audit as pa  # noqa: E402
from precision_audit.policy import LossScaling, ModuleOverride, Policy, fingerprint, model_layout  # noqa: E402

SAMPLES = ("mlp", "cnn", "tiny_gpt", "fp16_trouble")


def _sample(name: str) -> tuple[torch.nn.Module, Any, Any, dict[str, str]]:
    spec = importlib.util.spec_from_file_location(f"sample_{name}", ROOT / "sample_models" / name / "model.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.build_model()
    batch = mod.sample_batch()
    loss_fn = getattr(mod, "loss_fn", None)
    pins = {"hot": "fp32"} if name == "fp16_trouble" else {}
    return model, batch, loss_fn, pins


def _hf(name: str) -> tuple[torch.nn.Module, Any, Any, dict[str, str]]:
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64, use_cache=False,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                      intermediate_size=128, vocab_size=1000, max_position_embeddings=64)
        model = transformers.BertForMaskedLM(cfg)
    ids = torch.randint(0, 1000, (8, 32))
    return model, {"input_ids": ids, "labels": ids}, None, {}


def _random_like(batch: Any, gen: torch.Generator) -> Any:
    if isinstance(batch, torch.Tensor):
        if batch.is_floating_point():
            return torch.randn(batch.shape, generator=gen)
        hi = int(batch.max()) + 1
        return torch.randint(0, max(hi, 2), batch.shape, generator=gen)
    if isinstance(batch, dict):
        out = {k: _random_like(v, gen) for k, v in batch.items()}
        if "labels" in out and "input_ids" in out:
            out["labels"] = out["input_ids"]
        return out
    return type(batch)(_random_like(v, gen) for v in batch)


def _loss(model: torch.nn.Module, batch: Any, loss_fn: Any) -> torch.Tensor:
    if isinstance(batch, dict):
        return model(**batch).loss.float()
    *inputs, target = batch
    out = model(*inputs)
    if loss_fn is not None:
        return loss_fn(out, batch).float()
    if target.is_floating_point():
        return F.mse_loss(out.float(), target)
    return F.cross_entropy(out.float(), target)


def run(name: str, steps: int, every: int, measure_only: bool = False) -> dict[str, Any]:
    model, batch, loss_fn, pins = _hf(name) if name in ("gpt2", "bert") else _sample(name)
    fp, n = fingerprint(model)
    policy = Policy(model_class=type(model).__name__, model_fingerprint=fp, model_modules=n, target_name="H100",
                    target_compute_capability=(9, 0), default_format="fp16",
                    modules={k: ModuleOverride(v, "the audit's pin") for k, v in pins.items()},
                    loss_scaling=LossScaling(enabled=True), model_layout=model_layout(model))
    handle = pa.apply_policy(model, policy)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctl = pa.controller(model, opt, policy, watch=True, watch_every=every, device="cpu")
    if measure_only:
        assert ctl.watch is not None
        ctl.watch.min_confidence = math.inf  # never act
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for _ in range(steps):
        b = _random_like(batch, gen)
        with pa.autocast(policy, "cpu"):
            loss = _loss(model, b, loss_fn)
        ctl.step(loss)
    wall = time.perf_counter() - t0
    handle.remove()
    ctl.close()
    w = ctl.watch
    assert w is not None
    return {"model": name, "modules": len(w.names), "readings": w.readings, "skipped": ctl.skipped_steps,
            "forecasts": w.log, "actions": [a.to_dict() for a in w.actions], "wall_s": wall,
            "last_loss": ctl.monitor.last.loss if ctl.monitor.last else None, "series": w.to_dict()["modules"]}


def _would_have(r: dict[str, Any]) -> None:
    """The forecasts that would have acted (10+ readings, crossing ahead within 200 steps, confidence >= 0.9), and
    whether the measured series then crossed the limit."""
    from precision_audit.runtime.watch import UNDERFLOW_LIMIT, format_max

    seen = set()
    for f in r["forecasts"]:
        key = (f["module"], f["kind"])
        if key in seen or not (f["points"] >= 10 and f["at"] <= f["step"] <= f["at"] + 200 and f["confidence"] >= 0.9):
            continue
        seen.add(key)
        s = r["series"][f["module"]]
        col, limit = (("underflow", UNDERFLOW_LIMIT) if f["kind"] == "underflow" else
                      ("output", format_max(f["format"]) or math.inf))
        crossed = next((st for st, v in zip(s["step"], s[col]) if v is not None and v > limit), None)
        peak = max((v for v in s[col] if v is not None), default=None)
        print(f"  {r['model']}: would act at step {f['at']} on {f['module']} ({f['kind']}): forecast {f['step']}; "
              f"measured: {'crossed at step ' + str(crossed) if crossed else 'never crossed'} (peak {peak})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--only", default=",".join((*SAMPLES, "gpt2", "bert")))
    p.add_argument("--measure-only", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    print("| model | watched modules | readings | skipped steps | forecasts within 5 horizons | actions | "
          "last loss | wall (s) |\n|---|---|---|---|---|---|---|---|")
    details = []
    for name in args.only.split(","):
        r = run(name, args.steps, args.every, args.measure_only)
        print(f"| {name} | {r['modules']} | {r['readings']} | {r['skipped']} | {len(r['forecasts'])} | "
              f"{len(r['actions'])} | {r['last_loss']:.4g} | {r['wall_s']:.1f} |", flush=True)
        details.append(r)
    for r in details:
        if args.measure_only:
            _would_have(r)
            continue
        for f in r["forecasts"][:10]:
            print(f"  {r['model']}: forecast {f}")
        for a in r["actions"]:
            print(f"  {r['model']}: ACTION {a}")
            s = r["series"][a["module"]]
            key = "underflow" if "below the normal range" in a["reason"] else "output"
            print(f"    the measured {key} series of {a['module']} (step: value): "
                  + ", ".join(f"{st}: {v}" for st, v in zip(s["step"], s[key])))


if __name__ == "__main__":
    main()
