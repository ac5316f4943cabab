"""Runtime overhead: a training step with the policy applied and the controller, against the same step written by
hand with the same guarantees (issue 33, decision 3), measured in one run.

    python bench/runtime_overhead.py [--repeats 300] [--format bf16|fp16] [--count] [--ab]
    python bench/runtime_overhead.py --watch [--native] [--every 10,1] [--format bf16|fp16] [--cpu-time]
    python bench/runtime_overhead.py --device cuda                                   # on a GPU: 512 wide
    PA_WIDTH=4096 PA_BATCH=8192 python bench/runtime_overhead.py --device cuda --repeats 50

Every row runs the residual-MLP probe (bench/models/residual_mlp.py; PA_DEPTH, PA_WIDTH, PA_BATCH pick its size)
under the same autocast (CUDA's emulated on a CPU, torch's own with ``--device cuda``) with the same optimizer; the
policy keeps two modules in FP32, and the hand-written steps keep the same two in FP32 by hand (``KeptInFp32``).

- **baseline: by hand, same guarantees** — for ``bf16``, autocast, backward, the gradients' total norm, one read
  of whether it is finite, no update when it is not (``torch.nn.utils.get_total_norm``, one device sync); for
  ``fp16``, autocast + ``torch.amp.GradScaler`` (its found-inf check and skip, one sync). The ratio column is
  against this row.
- by hand, no check: autocast and the update, nothing else (the bare step, for reference);
- ``apply_policy`` + ``controller.step``: the policy's module wrappers, ``precision_audit.autocast`` on a GPU (the
  CPU rows use the emulation for every row), and the controller with everything it does on a clean step (the
  total norm and flags, its one sync, the monitor, the TF32 marks, the hooks that let it name a bad step's source);
- the same after ``controller.close()`` (no source hooks), and the policy's wrappers with the step by hand.

Rounds are interleaved, the order of the rows rotating every round, so that load that drifts hits every row alike;
the ratios are medians over rounds of each round's paired ratio (with a bootstrap interval for the headline one).
``--ab`` times the headline pair only, back to back and alternating, which a loaded machine disturbs less.
``--watch`` (issue 36) times the controller's step without the watch against the same step with ``watch=True``
(read every N steps for each N of ``--every``: 10, the default, and 1 unless told), each on its own copy of the
model with one controller throughout, the rows rotating every round: the watch's cost as a ratio of total times.
``--cpu-time`` (CPU only) times by the process's CPU time on one thread instead of the wall clock, which other
processes' load barely moves (a shared machine); the ratios then compare the work each step does.
``--count`` also counts, per step, the operators dispatched (those that are not views: about one kernel launch
each on a GPU), the reads to the host (device syncs) and the tensors made from host data, with a counting
``TorchDispatchMode``: the CPU's proxy for what a launch-bound GPU step pays.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import precision_audit as pa  # noqa: E402
from precision_audit.emulation.autocast import CudaAutocastPolicy, emulated_autocast  # noqa: E402
from precision_audit.loading import load_batch, load_model, resolve_loss  # noqa: E402
from precision_audit.model_names import fingerprint, model_layout
from precision_audit.policy.schema import LossScaling, ModuleOverride, Policy  # noqa: E402

FP32_MODULES = ("blocks.0.fc1", "head")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ROWS = {  # key: label
    "checked": "baseline: by hand, same guarantees",
    "bare": "by hand, no check",
    "ours": "apply_policy + controller.step",
    "no_hooks": "  the same after controller.close()",
    "wrappers": "apply_policy, the step by hand",
}


class KeptInFp32(torch.nn.Module):
    """What a user writes by hand to keep a module in FP32 inside an autocast region."""

    def __init__(self, inner: torch.nn.Module, device_type: str) -> None:
        super().__init__()
        self.inner, self.device_type = inner, device_type

    def forward(self, x):
        with torch.autocast(self.device_type, enabled=False):
            return self.inner(x.float())


def by_hand_model(model: torch.nn.Module, device_type: str) -> torch.nn.Module:
    """A copy of ``model`` with FP32_MODULES kept in FP32 by hand, as the policy keeps them."""
    hand = copy.deepcopy(model)
    for name in FP32_MODULES:
        parent, _, leaf = name.rpartition(".")
        owner = hand.get_submodule(parent) if parent else hand
        setattr(owner, leaf, KeptInFp32(getattr(owner, leaf), device_type))
    return hand


_SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "item"}


def _is_view(func) -> bool:
    """An operator whose output aliases an input without writing it (a view: no kernel)."""
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


class CountOps(TorchDispatchMode):
    """Counts dispatched operators that are not views or allocations (about one kernel launch each on a GPU), reads
    to the host (``item``/``bool``/``tolist``: a device sync each on a GPU) and tensors made from host data
    (``torch.tensor([...], device=...)``: on a GPU a copy from pageable memory, which waits for the stream too)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: collections.Counter[str] = collections.Counter()
        self.syncs = 0
        self.from_host = 0
        self._tolist = torch.Tensor.tolist

    def __enter__(self):
        counter = self
        tolist = self._tolist

        def counted_tolist(t):
            counter.syncs += 1
            return tolist(t)

        torch.Tensor.tolist = counted_tolist  # type: ignore[method-assign]  # a CPU tolist dispatches nothing
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _SYNC_OPS:
            self.syncs += 1
        elif name == "lift_fresh":
            self.from_host += 1
        elif not (_is_view(func) or name.startswith("empty") or name in ("set_", "alias")):
            self.kernels[name] += 1
        return func(*args, **(kwargs or {}))


def _median_ci(values: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median (percentile method, fixed seed)."""
    g = torch.Generator().manual_seed(0)
    v = torch.tensor(values, dtype=torch.float64)
    idx = torch.randint(len(values), (resamples, len(values)), generator=g)
    meds = v[idx].median(dim=1).values.sort().values
    return float(meds[int(0.025 * resamples)]), float(meds[int(0.975 * resamples) - 1])


def watch_overhead(model, policy, batch, spec, policy_autocast, one, dev: str, repeats: int,
                   every: tuple[int, ...] = (10, 1)) -> None:
    """controller.step without the watch and with watch=True read every N steps for each N of ``every``: one copy
    of the model per row, one controller each throughout, rotating every round; ratios of the total times."""
    rows = {"plain": ("controller.step", {})}
    for n in every:
        rows[f"every{n}"] = (f"  + watch=True, watch_every={n}", {"watch": True, "watch_every": n})
    steps, keep = {}, []
    for key, (_, kw) in rows.items():
        m = copy.deepcopy(model)
        handle = pa.apply_policy(m, policy, device_type=dev)
        ctl = pa.controller(m, torch.optim.SGD(m.parameters(), lr=1e-4), policy, device=dev, **kw)
        keep.append((handle, ctl))

        def step(m=m, ctl=ctl):
            with policy_autocast():
                loss = spec(m(*batch.args), batch)
            ctl.step(loss)
        steps[key] = step
    times: dict[str, list[float]] = {k: [] for k in rows}
    order = list(rows)
    for r in range(repeats + 10):
        rot = r % len(order)
        for key in order[rot:] + order[:rot]:
            t = one(steps[key])
            if r >= 10:
                times[key].append(t)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; residual MLP probe, {repeats} rotating "
          f"rounds; {sum(1 for _ in model.modules())} modules")
    # the watch costs on one step in N: the ratio of the rounds' total times (a median of per-round ratios would
    # hide it), with the median of the per-round ratios beside it for the steps it does not read
    for key, (label, _) in rows.items():
        ratios = [a / b for a, b in zip(times[key], times["plain"])]
        total = sum(times[key]) / sum(times["plain"])
        print(f"{label:<38} mean {statistics.fmean(times[key]) * 1e3:>8.3f} ms  ratio of totals {total:.4f}x  "
              f"(median per-round ratio {statistics.median(ratios):.4f}x)")
    for handle, ctl in keep:
        ctl.close()
        handle.remove()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cpu: CUDA autocast emulated on the CPU; cuda: the GPU, torch's own autocast (each step "
                         "timed between two device synchronisations)")
    ap.add_argument("--format", default="bf16", choices=tuple(DTYPES), help="the policy's default format")
    ap.add_argument("--count", action="store_true", help="also count operators and host reads per step")
    ap.add_argument("--ab", action="store_true",
                    help="time only the baseline and apply_policy + controller.step, alternating (ABBA), with the "
                         "policy applied and one controller throughout: the headline ratio, less exposed to load")
    ap.add_argument("--watch", action="store_true",
                    help="time controller.step without and with watch=True (every 10 steps and every step), each "
                         "on its own copy of the model, rotating: the watch's overhead as a paired ratio")
    ap.add_argument("--every", default="10,1",
                    help="with --watch: the watch_every values timed, comma-separated (default 10,1)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="on the CPU: time each step by the process's CPU time (time.process_time) on one thread, "
                         "not the wall clock: other processes' load then costs little (a shared machine)")
    ap.add_argument("--native", action="store_true",
                    help="with --watch on the CPU: torch's own CPU autocast instead of the emulated CUDA one")
    args = ap.parse_args()
    dev, dtype = args.device, DTYPES[args.format]
    model, source = load_model(str(ROOT / "bench" / "models" / "residual_mlp.py"))
    batch = load_batch(None, model, source)
    spec = resolve_loss(source, model(*batch.args), batch)
    model.to(dev)
    batch = batch.to(dev)
    scaling = args.format == "fp16"
    fp, n = fingerprint(model)
    policy = Policy(model_class=type(model).__name__, model_fingerprint=fp, model_modules=n, target_name="H100 SXM",
                    target_compute_capability=(9, 0), default_format=args.format,
                    modules={m: ModuleOverride("fp32", "bench") for m in FP32_MODULES},
                    loss_scaling=LossScaling(enabled=scaling, init_scale=2.0 ** 12), model_layout=model_layout(model))

    def autocast():
        return torch.autocast("cuda", dtype) if dev == "cuda" else emulated_autocast(dtype)

    def policy_autocast():  # the documented loop's context on a GPU; the emulation (as every row) on a CPU
        return pa.autocast(policy, "cuda") if dev == "cuda" else emulated_autocast(dtype)

    def sync() -> None:
        if dev == "cuda":
            torch.cuda.synchronize()

    clock = time.perf_counter
    if args.cpu_time and dev == "cpu":
        torch.set_num_threads(1)  # no intra-op workers spinning (CPU time too) or contending
        clock = time.process_time

    def one(step) -> float:
        sync()
        t0 = clock()
        step()
        sync()
        return clock() - t0

    if args.watch:
        every = tuple(int(v) for v in args.every.split(","))
        if args.native:  # torch's own CPU autocast: no emulation layer around the watch's kernels
            with contextlib.nullcontext():
                watch_overhead(model, policy, batch, spec, lambda: pa.autocast(policy, "cpu"), one, dev, args.repeats,
                               every)
            return
        with CudaAutocastPolicy() if dev == "cpu" else contextlib.nullcontext():
            watch_overhead(model, policy, batch, spec, policy_autocast, one, dev, args.repeats, every)
        return
    with CudaAutocastPolicy() if dev == "cpu" else contextlib.nullcontext():
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        hand = by_hand_model(model, "cuda" if dev == "cuda" else "cpu")
        hand_opt = torch.optim.SGD(hand.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler(dev, init_scale=2.0 ** 12, enabled=scaling)
        box: dict = {}

        def bare(net, optimizer):
            def step():
                with autocast():
                    loss = spec(net(*batch.args), batch)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
            return step

        def checked(net, optimizer):
            # bf16: the controller's guarantee written by hand (the gradients' total norm, no update when it is not
            # finite, one device sync); fp16: GradScaler's own found-inf check and skip (one sync in its step)
            if scaling:
                return bare(net, optimizer)
            params = [p for p in net.parameters() if p.requires_grad]

            def step():
                with autocast():
                    loss = spec(net(*batch.args), batch)
                loss.backward()
                norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
                if bool(torch.isfinite(norm)):
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            return step

        steps = {"checked": checked(hand, hand_opt), "bare": bare(hand, hand_opt)}
        policy_by_hand = bare(model, opt)

        def with_policy():
            with policy_autocast():
                loss = spec(model(*batch.args), batch)
            box["controller"].step(loss)

        def run(what: str) -> float:
            if what in steps:
                return one(steps[what])
            handle = pa.apply_policy(model, policy, device_type=dev)
            try:
                if what == "wrappers":
                    return one(policy_by_hand)
                box["controller"] = ctl = pa.controller(model, opt, policy, device=dev)
                if what == "no_hooks":
                    ctl.close()
                t = one(with_policy)
                ctl.close()
                return t
            finally:
                handle.remove()

        times: dict[str, list[float]] = {k: [] for k in (("checked", "ours") if args.ab else ROWS)}
        if args.ab:  # the headline pair only, the policy applied and one controller throughout, as in training
            handle = pa.apply_policy(model, policy, device_type=dev)
            box["controller"] = ctl = pa.controller(model, opt, policy, device=dev)
            pair = {"checked": steps["checked"], "ours": with_policy}
            for r in range(args.repeats + 5):
                for what in (("checked", "ours"), ("ours", "checked"))[r % 2]:
                    t = one(pair[what])
                    if r >= 5:  # warm-up rounds
                        times[what].append(t)
            ctl.close()
            handle.remove()
        else:
            order = list(ROWS)
            for r in range(args.repeats + 5):
                rot = r % len(order)
                for what in order[rot:] + order[:rot]:
                    t = run(what)
                    if r >= 5:  # warm-up rounds
                        times[what].append(t)
        counts = {}
        if args.count:
            for what in times:
                run(what)  # warm
                with CountOps() as c:
                    run(what)
                counts[what] = c
    where = (f"{torch.cuda.get_device_name()}, torch's {args.format} autocast" if dev == "cuda"
             else f"{torch.get_num_threads()} threads, emulated {args.format}")
    print(f"torch {torch.__version__}, {where}; residual MLP probe {model.blocks[0].fc1.in_features} wide, "
          f"{len(model.blocks)} blocks, batch {batch.args[0].shape[0]}; {args.repeats} interleaved rounds"
          + (" (A/B: the baseline and the controller's step alternating)" if args.ab else ""))
    head = f"{'step':<38} {'median ms':>10} {'ratio':>7}"
    if counts:
        head += f" {'ops/step':>9} {'syncs':>6} {'from host':>9}"
    print(head)
    for what in times:
        ratio = statistics.median(a / b for a, b in zip(times[what], times["checked"]))
        line = f"{ROWS[what]:<38} {statistics.median(times[what]) * 1e3:>10.3f} {ratio:>6.3f}x"
        if counts:
            line += f" {sum(counts[what].kernels.values()):>9} {counts[what].syncs:>6} {counts[what].from_host:>9}"
        print(line)
    ratios = [a / b for a, b in zip(times["ours"], times["checked"])]
    lo, hi = _median_ci(ratios)
    q = statistics.quantiles(ratios, n=4)
    print(f"apply_policy + controller.step / baseline, paired per round: median {statistics.median(ratios):.3f}x, "
          f"95% CI of the median {lo:.3f}-{hi:.3f}x, quartiles {q[0]:.3f}-{q[2]:.3f}x")
    if "no_hooks" in times:
        hooks = statistics.median(a - b for a, b in zip(times["ours"], times["no_hooks"]))
        print(f"source-attribution hooks, paired per round: {hooks * 1e3:+.3f} ms per step "
              f"({hooks / statistics.median(times['no_hooks']):+.1%} of the step without them)")
    if counts:
        extra = counts["ours"].kernels - counts["checked"].kernels
        fewer = counts["checked"].kernels - counts["ours"].kernels
        print(f"operators the controller's step adds to the baseline's: {dict(extra) or 'none'}; "
              f"and does not run: {dict(fewer) or 'none'}")


if __name__ == "__main__":
    main()
