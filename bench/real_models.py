"""P1 and P5 on the models people actually train (issue 14 item 7): audit cost against one FP32 training step.

    python bench/real_models.py [--models gpt2,bert,...] [--kernels python] [--json out.json]
    python bench/real_models.py --device cuda --batch 8     # on a GPU: cuda mode, GPU peak memory

Each model is built from transformers' default configuration with random weights (nothing is downloaded:
``HF_HUB_OFFLINE=1``, no ``from_pretrained``), in train mode as built, on a small batch chosen so that one FP32
forward+backward takes roughly 0.3-3 s on a 2-core CPU:

    gpt2      GPT-2 124M (GPT2Config())                                   1 x 64 tokens
    bert      BERT-base (BertConfig(), masked LM)                         1 x 64 tokens
    t5        T5-small (T5Config())                                       2 x 64 tokens
    llama     Llama-style decoder, GPT-2's width and depth (768 x 12)     1 x 64 tokens
    vit       ViT-B/16 (ViTConfig())                                      1 image, 224 x 224
    resnet50  ResNet-50 (ResNetConfig())                                  2 images, 224 x 224
    convnext  ConvNeXt-T (ConvNextConfig())                               1 image, 224 x 224
    whisper   Whisper-tiny (WhisperConfig() at tiny's sizes)              1 x 10 s of log-mel, 32 decoder tokens

Per model, in fresh subprocesses (one for the training steps, one for the audit):

- FP32 step: the median of 7 timed forward+backward steps (10 on a GPU), after two warm-up steps;
- audit: the wall time of ``run_audit`` with default options (emulated mode on a CPU, both formats, the report
  written), loading the model and the batch from the files as a user's ``precision-audit audit`` would (after
  the process has started and imported torch, transformers and precision_audit: start-up is not counted);
- loading: the audit's ``load_subject`` (importing the user's model file, transformers' lazy import of the model
  class, ``build_model()`` with its random weights, ``torch.load`` of the batch), timed inside that audit, which a
  training run pays for too and the FP32 step is timed after;
- **P1 = (audit - loading) / FP32 step** (issue 33: goal at most 7x for the median model, at most 12x for every
  model); "P1 with loading" = audit / FP32 step, as issue 14 counted it;
- loading ratio: ``load_subject`` alone against a plain ``import`` + ``build_model()`` + ``torch.load`` of the same
  files, each in fresh processes (``--load-repeats`` of each, alternating; medians), goal at most 1.1x: the audit
  adds nothing to loading that a user would notice;
- the second order: what the audit re-measured at the second reduction order (docs/plan.md, "Noise floor"): the
  formats re-checked, "impacts" when the reference pass was repeated for the planner, and the plan's
  verification passes (at the second order / in all);
- peak RSS above the post-import baseline (torch, transformers and precision_audit imported; the model itself
  is built afterwards, so it is part of both figures), for one training step (VmHWM after the warm-up step) and
  for the audit (Linux: VmHWM reset through /proc/self/clear_refs);
- P5 = audit peak / training-step peak (goal: at most 1.5x).

``--floor`` also runs bench/cost_floor.py on each model with that audit's audit.json (the bare passes that audit
needed) and prints the audit after loading against it (goal: within 1.5x). ``--profile DIR`` also writes a
cProfile of each audit (``DIR/<model>.prof``; read it with ``python -m pstats``).
Not a test: the whole set takes many minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (config class, model class, config kwargs, batch kind, batch, sequence or image size)
MODELS: dict[str, tuple[str, str, dict, str, int, int]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}, "causal", 1, 64),
    "bert": ("BertConfig", "BertForMaskedLM", {}, "masked", 1, 64),
    "t5": ("T5Config", "T5ForConditionalGeneration", {"decoder_start_token_id": 0}, "seq2seq", 2, 64),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                   num_key_value_heads=12), "causal", 1, 64),
    "vit": ("ViTConfig", "ViTForImageClassification", {}, "image", 1, 224),
    "resnet50": ("ResNetConfig", "ResNetForImageClassification", {}, "image", 2, 224),
    "convnext": ("ConvNextConfig", "ConvNextForImageClassification", {}, "image", 1, 224),
    # WhisperConfig()'s defaults are a larger model; these are openai/whisper-tiny's sizes, with 10 s of audio
    # (500 encoder positions) instead of 30 s so that one step fits the time band
    "whisper": ("WhisperConfig", "WhisperForConditionalGeneration",
                dict(d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6,
                     decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536,
                     max_source_positions=500),
                "speech", 1, 32),
}

MODEL_PY = '''\
import torch
from transformers import {config_cls}, {model_cls}

CONFIG = {config!r}


def build_model():
    torch.manual_seed(0)
    return {model_cls}({config_cls}(**CONFIG))
'''

CHILD = r'''
import gc, json, os, statistics, sys, time
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["TRANSFORMERS_OFFLINE"] = "1"
what, model_py, sample, out, prof = sys.argv[1:6]
device = sys.argv[7]
import torch
import transformers  # noqa: F401  (part of the baseline: both children import it before measuring)
import precision_audit
from precision_audit.audit import AuditOptions, run_audit
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
cuda = device == "cuda"
resets = []  # the peaks before each reset of the statistics (the audit's timed steps reset them)
if cuda:
    torch.cuda.init(); torch.cuda.synchronize()
    _reset = torch.cuda.reset_peak_memory_stats
    def _recording_reset(*a, **k):
        resets.append(torch.cuda.max_memory_allocated())
        _reset(*a, **k)
    torch.cuda.reset_peak_memory_stats = _recording_reset
gc.collect(); reset_peak()
base = status("VmRSS")
def peak():
    # on a GPU: the device's peak allocation (the model, its gradients and the activations: nothing is on the GPU
    # at the baseline); on a CPU: the process's peak RSS above the post-import baseline
    if cuda:
        torch.cuda.synchronize()
        return max([torch.cuda.max_memory_allocated(), *resets])
    return status("VmHWM") - base
def sync():
    if cuda:
        torch.cuda.synchronize()
result = {"threads": torch.get_num_threads(), "module": precision_audit.__file__,
          "device": torch.cuda.get_device_name() if cuda else "cpu"}
if what == "step":
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_model", model_py)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    model = mod.build_model().to(device)
    batch = {k: v.to(device) for k, v in torch.load(sample).items()}
    def step():
        model.zero_grad(set_to_none=True)
        out = model(**batch)
        out.loss.backward()
    step()  # warm-up: its peak is the training step's (gradients allocated, activations alive at backward)
    result["peak_bytes"] = peak()
    step()  # a second warm-up: the first step after the first was often 10-30% slower (GPT-2 0.50 s, then 0.39)
    times = []
    for _ in range(10 if cuda else 7):
        sync(); t0 = time.perf_counter(); step(); sync(); times.append(time.perf_counter() - t0)
    result["step_s"] = statistics.median(times)
    result["step_times"] = times
elif what in ("load-audit", "load-plain"):
    t0 = time.perf_counter()
    if what == "load-audit":
        from precision_audit.audit import load_subject
        load_subject(AuditOptions(model=model_py, batch=sample, out=out))
    else:
        import importlib.util
        spec = importlib.util.spec_from_file_location("bench_model", model_py)
        mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
        mod.build_model()
        torch.load(sample)
    result["load_s"] = time.perf_counter() - t0
else:
    import precision_audit.audit as pa_audit
    _load_subject, loads = pa_audit.load_subject, []
    def timed_load(*a, **k):
        t = time.perf_counter()
        try:
            return _load_subject(*a, **k)
        finally:
            loads.append(time.perf_counter() - t)
    pa_audit.load_subject = timed_load
    extra = json.loads(sys.argv[6])
    opts = AuditOptions(model=model_py, batch=sample, out=out, device=device, **extra)
    marks = []
    def progress(msg):
        marks.append((time.perf_counter(), str(msg)))
    t0 = time.perf_counter()
    if prof:
        import cProfile
        pr = cProfile.Profile(); pr.enable()
    r = run_audit(opts, progress)
    if prof:
        pr.disable(); pr.dump_stats(prof)
    t1 = time.perf_counter()
    result["audit_s"] = t1 - t0
    ends = [t for t, _ in marks[1:]] + [t1]
    result["stages"] = [[m, e - t] for (t, m), e in zip(marks, ends)]
    result["load_s"] = sum(loads)
    result["load_stage_s"] = sum(d for m, d in result["stages"] if m.startswith("loading the model"))
    result["peak_bytes"] = peak()
    result["exit_code"] = r.exit_code
    a = json.load(open(os.path.join(out, "audit.json")))
    result["kernels"] = (a.get("emulation") or {}).get("kernels") or a["options"].get("kernels")
    result["mode"] = a.get("mode")
    result["measured_step_s"] = {f: ((s or {}).get("step_time") or {}).get("measured_s")
                                 for f, s in (a.get("summary") or {}).items()}
    nf = a.get("noise_floor") or {}
    mixed = next((c for c in a["plan"]["candidates"] if c["label"] == "mixed"), None)
    result["second_order"] = {
        "rechecked": sorted(nf.get("second_order") or {}),
        "impacts": (nf.get("planner_impacts") or "").startswith("each module's"),
        "verify": mixed["verification_passes"] if mixed else 0,
        "verify_second": sum(1 for r in nf.get("rechecks") or []
                             if r["decision"].startswith("the mixed plan's verification") and r["rechecked"])}
print(json.dumps(result))
'''


def _batch(kind: str, batch: int, size: int, cfg) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    if kind == "image":
        return {"pixel_values": torch.randn(batch, 3, size, size, generator=g),
                "labels": torch.randint(0, getattr(cfg, "num_labels", 2), (batch,), generator=g)}
    if kind == "speech":
        feats = torch.randn(batch, cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=g)
        labels = torch.randint(1, cfg.vocab_size, (batch, size), generator=g)
        return {"input_features": feats, "labels": labels}
    ids = torch.randint(1, cfg.vocab_size, (batch, size), generator=g)
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    if kind == "masked":
        out["labels"][:, ::2] = -100
    return out


def prepare(name: str, work: Path, batch_size: int | None = None) -> tuple[Path, Path]:
    """The model file and the sample batch of ``name`` in ``work/name`` (``batch_size`` overrides the batch's
    first dimension)."""
    import torch
    import transformers

    cfg_cls, model_cls, kwargs, kind, batch, size = MODELS[name]
    batch = batch_size or batch
    cfg = getattr(transformers, cfg_cls)(**kwargs)
    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.py").write_text(MODEL_PY.format(config_cls=cfg_cls, model_cls=model_cls, config=kwargs))
    torch.save(_batch(kind, batch, size, cfg), d / "sample.pt")
    return d / "model.py", d / "sample.pt"


def child(what: str, model_py: Path, sample: Path, out: Path, prof: str = "", extra: dict | None = None,
          device: str = "cpu") -> dict:
    # run in ROOT: `python -c` puts the working folder first on sys.path, before PYTHONPATH, so a tree's children
    # started from another checkout imported that checkout's precision_audit (before/after runs compared one tree)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", CHILD, what, str(model_py), str(sample), str(out), prof,
                        json.dumps(extra or {}), device], capture_output=True, text=True, env=env, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"{what} child failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _load() -> str:
    try:
        return " ".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:
        return "?"


def _second(so: dict) -> str:
    """What the audit measured at the second order, in a few characters: "bf16", "fp16,bf16+impacts", "-"."""
    text = ",".join(so["rechecked"]) + ("+impacts" if so["impacts"] else "")
    if so["verify"]:
        text += f" verify {so['verify_second']}/{so['verify']}"
    return text or "-"


def _loading_ratio(model_py: Path, sample: Path, out: Path, repeats: int) -> tuple[float, float]:
    """Medians of the audit's ``load_subject`` and of a plain import + build + torch.load, fresh processes,
    alternating."""
    audit, plain = [], []
    for _ in range(repeats):
        audit.append(child("load-audit", model_py, sample, out)["load_s"])
        plain.append(child("load-plain", model_py, sample, out)["load_s"])
    return statistics.median(audit), statistics.median(plain)


def _floor(model_py: Path, sample: Path, audit_json: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "cost_floor.py"), str(model_py), "--batch", str(sample),
                        "--audit", str(audit_json)], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"cost_floor failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    ap.add_argument("--kernels", default=None, help="pass --kernels to the audit (default: its own default)")
    ap.add_argument("--json", default=None, help="also write the per-model results here")
    ap.add_argument("--profile", default=None, help="write a cProfile of each audit into this folder")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the training step and the audit run (cuda: the audit in cuda mode, and the peak "
                         "figures are the GPU's max_memory_allocated instead of the process's RSS)")
    ap.add_argument("--batch", type=int, default=None,
                    help="the batch's first dimension for every model (default: each model's own, above)")
    ap.add_argument("--load-repeats", type=int, default=3,
                    help="fresh processes per arm for the loading ratio (0: not measured)")
    ap.add_argument("--floor", action="store_true",
                    help="also run bench/cost_floor.py on the passes each audit needed, and compare")
    args = ap.parse_args()
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    extra = {"kernels": args.kernels} if args.kernels else {}
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    print(f"{os.cpu_count()} cpus, load average {_load()} at start; device {args.device}; batch "
          f"{args.batch or 'per model'}; audit options: defaults{extra or ''}", flush=True)
    print(f"{'model':<9} {'FP32 step':>9} {'audit':>7} {'loading':>7} {'P1':>6} {'with load':>9} {'load ratio':>10} "
          f"{'floor':>6} {'vs floor':>8} {'step peak':>9} {'audit peak':>10} {'P5':>6} {'second order':>22} "
          f"{'load':>14}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            model_py, sample = prepare(name, Path(tmp), args.batch)
            step = child("step", model_py, sample, Path(tmp) / name / "o", device=args.device)
            prof = str(Path(args.profile).resolve() / f"{name}.prof") if args.profile else ""
            audit = child("audit", model_py, sample, Path(tmp) / name / "out", prof, extra, args.device)
            p1 = (audit["audit_s"] - audit["load_s"]) / step["step_s"]  # issue 33: after loading
            p1_with = audit["audit_s"] / step["step_s"]
            p5 = audit["peak_bytes"] / max(step["peak_bytes"], 1)
            ratio = None
            if args.load_repeats:
                la, lp = _loading_ratio(model_py, sample, Path(tmp) / name / "o", args.load_repeats)
                ratio = la / lp
            floor = _floor(model_py, sample, Path(tmp) / name / "out" / "audit.json") if args.floor else None
            vs_floor = (audit["audit_s"] - audit["load_s"]) / floor["floor_s"] if floor else None
            row = {"model": name, "step_s": step["step_s"], "step_times": step["step_times"],
                   "audit_s": audit["audit_s"], "load_s": audit["load_s"], "load_stage_s": audit["load_stage_s"],
                   "p1": p1, "p1_with_loading": p1_with, "load_ratio": ratio,
                   "load_audit_s": la if ratio else None, "load_plain_s": lp if ratio else None,
                   "floor": floor, "vs_floor": vs_floor, "second_order": audit["second_order"],
                   "stages": audit["stages"], "step_peak_mb": step["peak_bytes"] / 2 ** 20,
                   "audit_peak_mb": audit["peak_bytes"] / 2 ** 20, "p5": p5, "kernels": audit["kernels"],
                   "exit_code": audit["exit_code"], "load": _load(), "threads": audit["threads"],
                   "device": audit["device"], "mode": audit["mode"], "measured_step_s": audit["measured_step_s"]}
            rows.append(row)
            ratio_t = f"{ratio:.2f}x" if ratio else "-"
            floor_t = f"{floor['floor_steps']:.1f}x" if floor else "-"
            vs_t = f"{vs_floor:.2f}x" if vs_floor else "-"
            print(f"{name:<9} {step['step_s']:>8.2f}s {audit['audit_s']:>6.1f}s {audit['load_s']:>6.1f}s {p1:>5.1f}x "
                  f"{p1_with:>8.1f}x {ratio_t:>10} {floor_t:>6} {vs_t:>8} {row['step_peak_mb']:>7.0f}MB "
                  f"{row['audit_peak_mb']:>8.0f}MB {p5:>5.2f}x {_second(audit['second_order']):>22} "
                  f"{row['load']:>14}", flush=True)
    if len(rows) > 1:
        print(f"P1 (after loading): median {statistics.median(r['p1'] for r in rows):.1f}x, max "
              f"{max(r['p1'] for r in rows):.1f}x (with loading: median "
              f"{statistics.median(r['p1_with_loading'] for r in rows):.1f}x, max "
              f"{max(r['p1_with_loading'] for r in rows):.1f}x); max P5 {max(r['p5'] for r in rows):.2f}x"
              + (f"; max loading ratio {max(r['load_ratio'] for r in rows):.2f}x" if args.load_repeats else "")
              + (f"; max audit / floor {max(r['vs_floor'] for r in rows):.2f}x" if args.floor else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
