"""P1 by pass: the FP32 reference pass and its repeat at the second reduction order, before/after in one process.

    OMP_NUM_THREADS=1 python bench/p1_passes.py MODEL.py [--batch BATCH.pt] [--rounds 3]

Builds one capture session on the model (default options: every capturable format, emulated, the default
kernels), runs the reference and format passes once, then times, in interleaved rounds, the reference pass
(``reference_run``) and the second order's impacts (``second_order_impacts``) in two variants of the same
code: "before" (the repeat records everything the first pass does, and the bf16 diff of every local re-run is
the masked ``where(isfinite(y), p - y, 0)``) and "after" (this branch: the repeat reads its impacts only, and
the diff is one subtraction where y is known finite). It checks that both variants give the same figures
(every local error, loss impact and second-order impact exactly equal) and prints median times per variant.
Figures and the load they ran under: bench/README.md, "P1: the reference pass at two orders".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from precision_audit.audit import SubjectRun, load_subject, set_up  # noqa: E402
from precision_audit.capture import reference_pass as RP  # noqa: E402
from precision_audit.capture.noise import second_order_impacts, second_threads  # noqa: E402
from precision_audit.capture.session import CaptureConfig, CaptureSession  # noqa: E402
from precision_audit.capture.session_state import PassState  # noqa: E402
from precision_audit.options import AuditOptions  # noqa: E402

NEW_DIFF = RP._diff_bf16


def _old_diff(y: torch.Tensor, p: torch.Tensor, finite: bool | None) -> torch.Tensor:
    return torch.where(torch.isfinite(y), p.float() - y, 0.0).to(torch.bfloat16)


class _Before(PassState):
    """The session's state as before: the repeat at the second order records everything (the flag cannot be set)."""

    impacts_only = property(lambda self: False, lambda self, value: None)  # type: ignore[assignment]


def _variant(session: CaptureSession, before: bool) -> None:
    session.state.__class__ = _Before if before else PassState
    RP._diff_bf16 = _old_diff if before else NEW_DIFF  # type: ignore[assignment]


def _figures(session: CaptureSession) -> dict:
    out = {}
    for rec in session.layers.values():
        for f, fs in rec.formats.items():
            loc = fs.local
            out[(rec.name, f)] = (fs.loss_impact, fs.loss_impact_abs,
                                  None if loc is None else (loc.n, loc.sum_ref2, loc.sum_diff2, loc.sum_dot,
                                                            loc.sum_p2, loc.max_abs, loc.nonfinite))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--batch", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    opts = AuditOptions(model=args.model, batch=args.batch)
    subject = load_subject(opts)
    setup = set_up(opts)
    run = SubjectRun(subject.source, subject.batch, setup.device)
    config = CaptureConfig(formats=setup.formats, device=setup.device, mode=setup.mode, seed=opts.seed,
                           timed_steps=0, kernels=setup.kernels)
    alt = second_threads(torch.get_num_threads())
    times: dict[str, list[float]] = {k: [] for k in ("ref before", "ref after", "2nd before", "2nd after")}
    seen: dict[str, tuple] = {}
    with CaptureSession(subject.model, run.forward, run.loss_of, config) as s:
        s.reference_run()  # warm-up: kernels built, caches filled
        for f in setup.formats:
            s.format_run(f)
        for r in range(args.rounds):
            for before in ((True, False) if r % 2 == 0 else (False, True)):
                tag = "before" if before else "after"
                _variant(s, before)
                s.layers, s.state.ref_outputs = {}, {}
                t0 = time.perf_counter()
                s.reference_run()
                times[f"ref {tag}"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                impacts, note = second_order_impacts(s, alt)
                times[f"2nd {tag}"].append(time.perf_counter() - t0)
                seen[tag] = (_figures(s), impacts, note)
        _variant(s, False)
    same = seen["before"] == seen["after"]
    print(f"model {args.model}; formats {', '.join(f.value for f in setup.formats)}; threads "
          f"{torch.get_num_threads()} and {alt}; {args.rounds} interleaved rounds; figures identical: {same}")
    for k, v in times.items():
        print(f"  {k:11s} median {statistics.median(v):7.3f} s   ({', '.join(f'{x:.3f}' for x in v)})")
    for part in ("ref", "2nd"):
        b, a = statistics.median(times[f"{part} before"]), statistics.median(times[f"{part} after"])
        print(f"  {part}: after/before {a / b:.2f}")
    if not same:
        raise SystemExit("the two variants gave different figures")


if __name__ == "__main__":
    main()
