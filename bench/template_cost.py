"""What the report template's compiled-code cache saves (report/template_cache.py): ``render_html`` of one audit's
record in a new jinja2 environment (as a new process has), the template compiled afresh vs loaded from the cache,
interleaved; checks that every page is the same.

    python bench/template_cost.py OUT [--rounds 7]      # OUT: an audit's --out folder (audit.json, policy.json)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from precision_audit.record.codec import from_json
from precision_audit.report import html


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    record = from_json(json.loads((Path(args.out) / "audit.json").read_text()))
    policy = json.loads((Path(args.out) / "policy.json").read_text())
    when = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    times: dict[str, list[float]] = {"compiled": [], "cached": []}
    pages = set()
    with tempfile.TemporaryDirectory() as d:
        os.environ["XDG_CACHE_HOME"] = d
        for _ in range(args.rounds):
            for arm in times:
                if arm == "compiled":
                    shutil.rmtree(Path(d) / "precision-audit", ignore_errors=True)
                html._env.cache_clear()
                t = time.perf_counter()
                pages.add(html.render_html(record, policy, when))
                times[arm].append(time.perf_counter() - t)
    for arm, v in times.items():
        print(f"{arm:>8}: median {statistics.median(v):.3f} s, min {min(v):.3f} s")
    print(f"identical pages: {len(pages) == 1}; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
