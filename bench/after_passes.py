"""What an audit costs after its passes: the analysis, the planner's decisions and the writing of the outputs, timed
in one process on the results of one audit (docs/performance.md, "After the passes").

    python bench/after_passes.py MODEL [--batch BATCH] [--repeats 7] [--hashes] [--profile DIR]
    PA_DEPTH=16 PA_WIDTH=256 PA_BATCH=64 python bench/after_passes.py bench/models/residual_mlp.py
    python bench/after_passes.py /tmp/rm/llama/model.py --batch /tmp/rm/llama/sample.pt   # bench/real_models.py's

One audit runs first (default options, ``--steps 0``), keeping what the planner's step received, and is timed
whole, as is a second audit in the same process after the repeats. Then each part runs ``--repeats`` times on
those same results and the medians are printed:

- ``analyse``: precision_audit/analysis/findings.py ``analyse`` on the final capture and noise floor;
- ``decide``: precision_audit/planning/second_order.py ``decide`` (analysis and planner, re-run as the audit runs
  them; the second order's passes, already measured, are not run again);
- ``to_json``: the record to audit.json's document (precision_audit/record/codec.py);
- ``audit.json``, ``policy.json``: the document and its text, as precision_audit/audit.py writes them;
- ``report.html``: ``render_html`` of the record (the template's compiled code cached, as after a first audit;
  the record converted to audit.json's document and read back included);
- ``tb events``: precision_audit/report/tensorboard.py ``write_scalars`` into a new folder;
- ``write``: the whole writing stage of ``run_audit`` (audit.json, policy.json, report.html and the events,
  staged and moved into place: precision_audit/audit.py ``_write_outputs``).

``--hashes`` prints a SHA-256 of audit.json (its ``created`` and ``options.out`` fixed), policy.json and
report.html (its generation time fixed), so that two versions of the code can be compared on the same model.
The import of ``torch.utils.tensorboard`` that the first write of a process paid for before the events were
written directly (report/event_file.py) is not in these repeats: measure it with ``python -X importtime``.
The parts run what this checkout's audit.py runs (also a checkout from before record/json_text.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--batch")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--hashes", action="store_true")
    ap.add_argument("--profile", metavar="DIR",
                    help="also write a cProfile of one more run of each part: DIR/<part>.prof")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import precision_audit.audit as A
    import precision_audit.planning.verified as V
    from precision_audit.analysis.findings import analyse
    from precision_audit.planning.rules import plan_mixed_precision
    from precision_audit.planning.second_order import decide
    from precision_audit.record.codec import to_json
    from precision_audit.report.html import render_html
    from precision_audit.report.tensorboard import write_scalars

    kept: dict = {}
    real = V.plan_and_verify

    def keeping(session, capture, noise, perf, formats, target_name, budget, model, say, make_policy):
        kept.update(capture=capture, noise=noise, perf=perf, formats=formats, target=target_name, budget=budget,
                    model=model)
        return real(session, capture, noise, perf, formats, target_name, budget, model, say, make_policy)

    A.plan_and_verify = keeping
    with tempfile.TemporaryDirectory() as tmp:
        opts = A.AuditOptions(model=args.model, batch=args.batch, out=str(Path(tmp) / "out"), steps=0)
        t0 = time.perf_counter()
        result = A.run_audit(opts)
        first = time.perf_counter() - t0
        k = kept
        # fixed, so that --hashes compares two versions of the code, not two runs
        result.record.created, result.record.options.out = "2026-01-01T00:00:00+00:00", "out"

        def plan(analysis):
            return plan_mixed_precision(analysis, k["capture"], k["perf"], k["formats"], k["target"], k["model"])

        def html() -> str:
            result._html = None
            return result.to_html()

        n = [0]

        def events() -> None:
            n[0] += 1
            write_scalars(result.record, Path(tmp) / "tb" / str(n[0]))

        def write() -> None:
            n[0] += 1
            out = Path(tmp) / "w" / str(n[0])
            if hasattr(result, "_texts"):  # audit.json's document shared with the page
                result._html = None
                A._write_outputs(out, out, result.record, *result._texts(), result.policy, result.traces)
            else:
                A._write_outputs(out, out, result.record, result.policy, html(), result.traces)

        try:
            from precision_audit.record.json_text import dumps
        except ImportError:  # before it

            def dumps(doc, indent):
                return json.dumps(doc, indent=indent, allow_nan=False)

        parts = {
            "analyse": lambda: analyse(k["capture"], k["budget"], k["noise"]),
            "decide": lambda: decide(k["capture"], k["noise"], k["budget"], plan, lambda todo: None, lambda: None),
            "to_json": lambda: to_json(result.record),
            "audit.json": lambda: dumps(to_json(result.record), 1),
            "policy.json": lambda: dumps(result.policy.to_dict(), 2),
            "report.html": html,
            "tb events": events,
            "write": write,
        }
        times: dict[str, list[float]] = {p: [] for p in parts}
        for _ in range(args.repeats):
            for name, fn in parts.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        if args.profile:
            import cProfile

            Path(args.profile).mkdir(parents=True, exist_ok=True)
            for name, fn in parts.items():
                with cProfile.Profile() as pr:
                    fn()
                pr.dump_stats(Path(args.profile) / f"{name.replace(' ', '_')}.prof")
        t0 = time.perf_counter()
        A.run_audit(dataclasses.replace(opts, out=str(Path(tmp) / "second")))
        second = time.perf_counter() - t0
        print(f"{args.model}: {len(result.record.layers)} modules; audits {first:.2f} s, then {second:.2f} s; "
              f"load average {os.getloadavg()[0]:.1f}; python {sys.version.split()[0]}")
        for name, v in times.items():
            print(f"  {name:<12} median {statistics.median(v) * 1e3:8.1f} ms   min {min(v) * 1e3:8.1f} ms")
        if args.hashes:
            texts = {"audit.json": json.dumps(to_json(result.record), indent=1, allow_nan=False),
                     "policy.json": json.dumps(result.policy.to_dict(), indent=2, allow_nan=False),
                     "report.html": render_html(result.record, result.policy.to_dict(),
                                                _dt.datetime(2026, 1, 1, tzinfo=_dt.timezone.utc))}
            for name, text in texts.items():
                print(f"  {name:<12} sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}")


if __name__ == "__main__":
    main()
