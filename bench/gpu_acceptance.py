"""Issue 31's acceptance checks on a GPU, one figure each, and the one table bench/gpu_checks.sh ends with.

    python bench/gpu_acceptance.py CHECK --results FILE [--out DIR]    # one check; appends its row(s) to FILE
    python bench/gpu_acceptance.py table FILE                          # the table of every row in FILE
    python bench/gpu_acceptance.py table --dry-run                     # the table's layout, nothing measured
    python bench/gpu_acceptance.py row STEP FIGURE PASS --results FILE # a row written by the shell script

Each row is one JSON line: ``{"step", "figure", "goal", "pass", "note"}``; ``pass`` is true, false, or null for a
figure that calibrates rather than passes (or was not measured). Checks (docs/gpu.md says what each measures):

- ``speedup``: the cost model's BF16-over-FP32 speed-up against the measured one on tests/gpu/test_performance_gpu.py's
  GPT (12 x 1024, 16 x 512 tokens), the detected GPU as the target; goal: within 20%;
- ``dropout``: a train-mode GPT-2 (transformers' defaults: dropout 0.1) at batch 8: its bf16 output error at the
  second reduction order (the noise floor) against the first; goal: within 2x;
- ``tf32``: bench/tf32_backward_check.py on the GPU: a tf32 policy's backward under TF32, an fp32 module's not;
- ``fp8``: the FP8 plan of sample_models/fp8_outliers applied with real kernels (emulate=False, compute
  capability >= 8.9: ``torch._scaled_mm`` counted) and trained 20 steps, then each torchao recipe on every
  16-aligned linear, 5 steps (a row each); goal: the kernels ran, every loss finite;
- ``nccl``: ``precision-audit --nproc 1 --device cuda`` (one rank, NCCL) on sample_models/mlp; goal: the audit
  written (exit 0 or 1);
- ``audit-time``: from bench/real_models.py's JSON for GPT-2 at batch 32: the audit after loading against 3 s + 15
  FP32 training steps; and the loading stage against a plain import + build + batch load (DESIGN 6c: at most 1.1x);
- ``runtime``: bench/runtime_overhead.py on the GPU, the paired median ratio of the policy's step to the
  hand-written one with the same guarantees (issue 33, decision 3), on the launch-bound 512-wide probe (goal at most
  1.10x) and on the 4096-wide one that fills the GPU (at most 1.03x);
- ``calibration``: the achieved share of the peak of the GPT's GEMMs in bf16 and fp32, and of the bandwidth by a
  copy, beside analysis/cost.py's constants (no goal: the figures to calibrate them with).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

CHECKS = ("nccl", "dropout", "tf32", "fp8", "audit-time", "speedup", "runtime", "calibration")
#: the steps the table lists when nothing was measured (--dry-run), in the order the script runs them
STEPS = (("nccl", "1-GPU --nproc 1 audit on NCCL", "audit written (exit 0 or 1)"),
         ("dropout", "train-mode GPT-2 (dropout 0.1): bf16 output error, 2nd order / 1st", "within 2x"),
         ("tf32", "tf32 policy: TF32 switches in the backward", "tf32 on, fp32 off"),
         ("fp8", "fp8_outliers: 20 steps on real FP8 kernels", "_scaled_mm ran, losses finite"),
         ("audit-time", "GPT-2 batch 32: audit after loading", "<= 3 s + 15 FP32 steps"),
         ("loading", "GPT-2: audit's loading / plain import+build+load", "<= 1.1x"),
         ("speedup", "GPT 12x1024: BF16/FP32 predicted / measured", "within 20%"),
         ("runtime", "apply_policy + controller.step / the step by hand, same guarantees",
          "<= 1.03x 4096 wide, <= 1.10x 512 wide"),
         ("calibration", "achieved shares of peak (GEMMs, bandwidth)", "(calibrates analysis/cost.py)"),
         ("gpu_tests", "python -m pytest -m gpu tests/gpu", "all pass"))


def row(step: str, figure: str, goal: str, passed: bool | None, note: str | None = None) -> dict:
    return {"step": step, "figure": figure, "goal": goal, "pass": passed, "note": note}


def _gpt_file(tmp: Path) -> Path:
    """tests/gpu/test_performance_gpu.py's GPT, as a model file."""
    f = tmp / "gpt_12_1024.py"
    f.write_text(textwrap.dedent(f"""
        import importlib.util, torch
        spec = importlib.util.spec_from_file_location("tiny_gpt_base",
                                                      {str(ROOT / 'sample_models/tiny_gpt/model.py')!r})
        base = importlib.util.module_from_spec(spec); spec.loader.exec_module(base)
        def build_model():
            return base.build_model(n_layer=12, d_model=1024, vocab_size=50304, block_size=512, n_head=16)
        loss_fn = base.loss_fn
        def sample_batch():
            g = torch.Generator().manual_seed(0)
            idx = torch.randint(0, 50304, (16, 512), generator=g)
            return idx, torch.roll(idx, -1, 1)
    """))
    return f


def check_speedup(out: Path) -> list[dict]:
    from precision_audit.audit import AuditOptions, run_audit

    a = run_audit(AuditOptions(model=str(_gpt_file(out)), out=out / "speedup", steps=3, formats=None)).audit
    measured = a["summary"]["fp32"]["step_time"]["measured_s"] / a["summary"]["bf16"]["step_time"]["measured_s"]
    predicted = a["estimates"]["speedup_vs_fp32"]["bf16"]
    ratio = predicted / measured
    return [row("speedup", f"{predicted:.2f}x / {measured:.2f}x = {ratio:.2f}", "within 20%",
                abs(ratio - 1) <= 0.2, f"target {a['target']['name']} ({a['target']['reason']})")]


def check_dropout(out: Path, device: str = "cuda") -> list[dict]:
    from real_models import prepare

    from precision_audit.audit import AuditOptions, run_audit
    from precision_audit.planning import second_order

    # the audit measures the second order only for decisions near their threshold (issue 33; docs/plan.md, "Noise
    # floor"), which a healthy GPT-2 has none of: every decision below its threshold is re-checked here, so that the
    # bf16 pass runs at the second order and replays the reference's dropout masks there
    second_order.near = lambda value, threshold, name=second_order.LOSS: (
        value is not None and math.isfinite(value) and value <= threshold)
    model_py, sample = prepare("gpt2", out / "gpt2-b8", batch_size=8)
    a = run_audit(AuditOptions(model=str(model_py), batch=str(sample), out=out / "dropout", device=device,
                               steps=0)).audit
    first = a["summary"]["bf16"]["output"]["rel_l2"]
    second = ((a.get("noise_floor") or {}).get("second_order") or {}).get("bf16", {}).get("output_rel_error")
    if not a["model"]["training"] or second is None or not first:
        return [row("dropout", "not measured", "within 2x", False,
                    f"training={a['model']['training']}, first={first}, second={second}")]
    r = second / first
    return [row("dropout", f"{second:.3g} / {first:.3g} = {r:.2f}", "within 2x", 0.5 <= r <= 2.0,
                f"GPT-2 in train mode, bf16 verdict: {a['summary']['bf16']['verdict']}; every decision below its "
                "threshold re-checked at the second order (forced)")]


def check_tf32(out: Path) -> list[dict]:
    p = subprocess.run([sys.executable, str(ROOT / "bench/tf32_backward_check.py"), "--device", "cuda"],
                       capture_output=True, text=True)
    if not p.stdout.strip():
        return [row("tf32", f"failed: exit {p.returncode}", "tf32 on, fp32 off", False, p.stderr[-300:])]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    got = r["readings"]
    return [row("tf32", f"tf32 backward {got['fc.backward']}, fp32 backward {got['conv.backward']}",
                "tf32 on, fp32 off", r["pass"])]


def _train_fp8(src: Path, plan, steps: int) -> tuple[list[str], int, list[float]]:
    """``plan`` applied with real kernels to a fresh copy of the sample, trained ``steps`` steps under CUDA bf16
    autocast: (converted modules, torch._scaled_mm calls, losses)."""
    import copy

    import torch

    from precision_audit.fp8.apply import apply_fp8
    from precision_audit.loading import load_batch, load_model, resolve_loss

    model, source = load_model(str(src))
    model = copy.deepcopy(model).cuda()
    batch = load_batch(None, model, source).to("cuda")
    calls = [0]
    real = torch._scaled_mm

    def counting(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    converted = apply_fp8(model, plan(model) if callable(plan) else plan, emulate=None)  # real kernels: fp8/apply.py
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    torch._scaled_mm = counting
    try:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            # the loss inside the autocast region, as torch.amp's examples have it: the sample's F.mse_loss of a
            # bf16 output and an fp32 target outside it fails in CUDA's backward ("Found dtype Float but expected
            # BFloat16", every recipe alike on the H200, 2026-11-28; the CPU kernel promotes)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out_ = model(*batch.args, **batch.kwargs)
                loss = resolve_loss(source, out_, batch)(out_, batch)
            loss.backward()
            opt.step()
            losses.append(float(loss))
    finally:
        torch._scaled_mm = real
    return converted, calls[0], losses


def check_fp8(out: Path) -> list[dict]:
    """The audit's FP8 plan trained 20 steps, then every torchao recipe on every 16-aligned linear, 5 steps each
    (under CUDA autocast torchao casts the input itself: docs/fp8.md, "Runtime")."""
    import torch

    from precision_audit.audit import AuditOptions, run_audit

    cc = torch.cuda.get_device_capability()
    goal = "_scaled_mm ran, losses finite"
    if cc < (8, 9):
        return [row("fp8", "not measured", goal, None, f"compute capability {cc[0]}.{cc[1]} has no FP8 kernels")]
    src = ROOT / "sample_models/fp8_outliers/model.py"
    res = run_audit(AuditOptions(model=str(src), out=out / "fp8", device="cuda", steps=0,
                                 formats="fp16,bf16,fp8_e4m3"))
    rows = []

    def every(recipe):
        return lambda model: {n: recipe for n, m in model.named_modules() if type(m) is torch.nn.Linear
                              and not m.in_features % 16 and not m.out_features % 16}

    runs = [("the audit's plan", res.policy, 20)] + [
        (recipe, every(recipe), 5) for recipe in ("fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_gw_hp")]
    for what, plan, steps in runs:
        try:
            converted, calls, losses = _train_fp8(src, plan, steps)
        except Exception as e:  # one recipe failing is a row, not the end of the check
            rows.append(row("fp8", f"{what}: failed", goal, False, f"{type(e).__name__}: {str(e)[:200]}"))
            continue
        ok = calls > 0 and all(math.isfinite(v) for v in losses) and bool(converted)
        rows.append(row("fp8", f"{what}: {len(converted)} FP8 module(s), {calls} _scaled_mm calls, loss "
                               f"{losses[0]:.4g} -> {losses[-1]:.4g}", goal, ok, f"modules {converted}"))
    return rows


def check_nccl(out: Path) -> list[dict]:
    d = out / "nccl"
    p = subprocess.run([sys.executable, "-m", "precision_audit", str(ROOT / "sample_models/mlp/model.py"),
                        "--nproc", "1", "--device", "cuda", "--steps", "1", "--out", str(d), "-q"],
                       capture_output=True, text=True)
    written = (d / "audit.json").is_file()
    mode = json.loads((d / "audit.json").read_text())["mode"] if written else None
    return [row("nccl", f"exit {p.returncode}, audit.json {'written' if written else 'missing'} ({mode})",
                "audit written (exit 0 or 1)", p.returncode in (0, 1) and written and mode == "cuda",
                None if p.returncode in (0, 1) else p.stderr.strip()[-300:])]


def _plain_load_s(model_py: Path, sample: Path) -> float:
    """A plain import + build + batch load, in a fresh process that has imported torch and transformers (as
    bench/real_models.py's audit child has before its clock starts)."""
    code = textwrap.dedent(f"""
        import time, importlib.util, torch, transformers
        t0 = time.perf_counter()
        spec = importlib.util.spec_from_file_location("m", {str(model_py)!r})
        m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
        model = m.build_model()
        batch = torch.load({str(sample)!r}, weights_only=True)
        print(time.perf_counter() - t0)
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    times = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        times.append(float(p.stdout.strip().splitlines()[-1]))
    return min(times)


def check_audit_time(out: Path, real_models_json: Path) -> list[dict]:
    rows = json.loads(real_models_json.read_text())
    r = rows[0] if isinstance(rows, list) else next(iter(rows.values()))
    after, step = r["audit_s"] - r["load_s"], r["step_s"]
    goal_s = 3.0 + 15 * step
    out_rows = [row("audit-time", f"{after:.2f} s (FP32 step {step * 1e3:.1f} ms)", f"<= {goal_s:.2f} s",
                    after <= goal_s, f"audit {r['audit_s']:.2f} s, loading {r['load_s']:.2f} s")]
    from real_models import prepare

    model_py, sample = prepare("gpt2", out / "gpt2-plain", batch_size=32)
    plain = _plain_load_s(model_py, sample)
    ratio = r["load_s"] / plain
    out_rows.append(row("loading", f"{r['load_s']:.2f} s / {plain:.2f} s = {ratio:.2f}x", "<= 1.1x",
                        ratio <= 1.1))
    return out_rows


#: the runtime probes: (environment, repeats, goal)
RUNTIME_PROBES = (({}, 100, 1.10), ({"PA_WIDTH": "4096", "PA_BATCH": "8192"}, 30, 1.03))


def runtime_ratio(text: str) -> tuple[float, str] | None:
    """The paired median ratio and its interval from bench/runtime_overhead.py's output, None when absent."""
    for line in text.splitlines():
        if line.startswith("apply_policy + controller.step / baseline, paired per round: median "):
            rest = line.split("median ", 1)[1]
            return float(rest.split("x", 1)[0]), rest.split(", ", 1)[1] if ", " in rest else ""
    return None


def check_runtime(out: Path) -> list[dict]:
    rows = []
    for env, repeats, goal in RUNTIME_PROBES:
        width = env.get("PA_WIDTH", "512")
        p = subprocess.run([sys.executable, str(ROOT / "bench/runtime_overhead.py"), "--device", "cuda", "--repeats",
                            str(repeats)], capture_output=True, text=True, env={**os.environ, **env})
        got = runtime_ratio(p.stdout)
        if got is None:
            rows.append(row("runtime", f"{width} wide: failed, exit {p.returncode}", f"<= {goal:.2f}x", False,
                            (p.stderr or p.stdout).strip()[-300:]))
            continue
        ratio, spread = got
        rows.append(row("runtime", f"{width} wide: {ratio:.3f}x", f"<= {goal:.2f}x", ratio <= goal, spread))
    return rows


def _share_of_gemm(m: int, n: int, k: int, dtype, peak_tflops: float) -> float:
    from precision_audit.analysis.gemm_bench import time_gemm

    return 2 * m * n * k / time_gemm(m, n, k, 1, dtype, "cuda") / 1e12 / peak_tflops


def check_calibration(out: Path) -> list[dict]:
    import torch

    from precision_audit.analysis import cost
    from precision_audit.analysis.gemm_bench import _time_callable, measured_gpu
    from precision_audit.capture.ops import GemmOp
    from precision_audit.formats import Format
    from precision_audit.tf32_switches import tf32_switches

    name, gpu = measured_gpu("cuda")
    if gpu is None:
        return [row("calibration", "not measured", "(calibrates analysis/cost.py)", None, f"{name} not in the table")]
    rows = []
    with tf32_switches(matmul=False, cudnn=False):  # FP32 on CUDA cores, as the audit's FP32 runs
        for fmt, dtype in ((Format.BF16, torch.bfloat16), (Format.FP32, torch.float32)):
            shapes = ((8192, 3072, 1024), (8192, 1024, 4096), (8192, 50304, 1024), (1024, 50264, 256))
            for m, n, k in shapes:
                got = _share_of_gemm(m, n, k, dtype, gpu.peak(fmt.value))
                g = GemmOp("mm", "matmul", m, n, k, 1, 2 * m * n * k, ())
                model = cost.achievable_share(g, fmt, gpu) * cost.gemm_efficiency(g, gpu)
                rows.append(row("calibration", f"{fmt.value} {m}x{n}x{k}: {got:.2f} of peak (model {model:.2f})",
                                "(calibrates analysis/cost.py)", None))
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")  # 256 MiB, copied: read + write
    y = torch.empty_like(x)
    t = _time_callable(lambda: y.copy_(x))
    share = 2 * x.numel() / t / (gpu.bandwidth_gbps * 1e9)
    rows.append(row("calibration", f"copy 256 MiB: {share:.2f} of the bandwidth (model {cost.BANDWIDTH_SHARE:.2f})",
                    "(calibrates analysis/cost.py)", None, f"measured on {name}"))
    return rows


def table(rows: list[dict]) -> str:
    """The acceptance table (markdown), every step listed: a step with no row is "not measured"."""
    seen = {r["step"] for r in rows}
    rows = rows + [row(s, "not measured", goal, None, "did not run (no row)") for s, _, goal in STEPS
                   if s not in seen]
    order = {s: i for i, (s, _, _) in enumerate(STEPS)}
    titles = {s: t for s, t, _ in STEPS}
    lines = ["| step | what | figure | goal | result |", "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: order.get(r["step"], len(order))):
        result = {True: "PASS", False: "FAIL", None: "—"}[r["pass"]]
        note = f" ({r['note']})" if r.get("note") and r["pass"] is not True else ""
        lines.append(f"| {r['step']} | {titles.get(r['step'], '')} | {r['figure']}{note} | {r['goal']} | {result} |")
    passed = sum(r["pass"] is True for r in rows)
    failed = sum(r["pass"] is False for r in rows)
    lines.append(f"\n{passed} passed, {failed} failed, {len(rows) - passed - failed} without a verdict")
    return "\n".join(lines)


def dry_run_rows(why: str = "not measured: no GPU") -> list[dict]:
    return [row(s, why, goal, None) for s, _, goal in STEPS]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("check", choices=(*CHECKS, "table", "row"))
    p.add_argument("file", nargs="*", help="table: the results file; row: STEP FIGURE PASS (true, false or none)")
    p.add_argument("--results", help="the results file a check appends its rows to")
    p.add_argument("--out", default=None, help="a folder for the checks' audits (default: a temporary one)")
    p.add_argument("--real-models-json", help="audit-time: bench/real_models.py's --json output")
    p.add_argument("--dry-run", action="store_true", help="table: the layout, every step not measured")
    a = p.parse_args(argv)
    if a.check == "table":
        rows = dry_run_rows() if a.dry_run or not a.file else \
            [json.loads(line) for line in Path(a.file[0]).read_text().splitlines() if line.strip()]
        print(table(rows))
        return 0 if all(r["pass"] is not False for r in rows) else 1
    if a.check == "row":  # from bench/gpu_checks.sh: a step that failed, timed out or was left out
        step, figure, passed = a.file
        goal = next((g for s, _, g in STEPS if s == step), "")
        with open(a.results, "a") as f:
            f.write(json.dumps(row(step, figure, goal, {"true": True, "false": False}.get(passed))) + "\n")
        return 0
    out = Path(a.out or tempfile.mkdtemp(prefix="gpu-acceptance-"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if a.check == "audit-time":
        rows = check_audit_time(out, Path(a.real_models_json))
    else:
        rows = {"speedup": check_speedup, "dropout": check_dropout, "tf32": check_tf32, "fp8": check_fp8,
                "nccl": check_nccl, "runtime": check_runtime, "calibration": check_calibration}[a.check](out)
    for r in rows:
        r["note"] = (r["note"] + "; " if r["note"] else "") + f"{time.perf_counter() - t0:.0f} s"
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if a.results:
        with open(a.results, "a") as f:
            f.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
