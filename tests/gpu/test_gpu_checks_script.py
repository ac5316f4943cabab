"""bench/gpu_checks.sh, the acceptance run of issue 31 on a GPU: it cannot run here, so its shell is syntax-checked
and its table (bench/gpu_acceptance.py) is checked on the CPU, with the layout it prints without a GPU."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import gpu_acceptance as ga  # noqa: E402


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_script_parses_and_its_dry_run_lists_every_step_not_measured():
    assert subprocess.run(["bash", "-n", str(ROOT / "bench/gpu_checks.sh")]).returncode == 0
    p = subprocess.run(["bash", str(ROOT / "bench/gpu_checks.sh"), "--dry-run"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("| ") and not ln.startswith("| step")]
    assert [ln.split(" | ")[0][2:] for ln in lines] == [s for s, _, _ in ga.STEPS]
    assert all("not measured: no GPU" in ln and ln.endswith("| — |") for ln in lines)
    assert p.stdout.rstrip().endswith(f"0 passed, 0 failed, {len(ga.STEPS)} without a verdict")


def test_the_table_shows_pass_fail_and_the_steps_that_wrote_no_row(tmp_path):
    results = tmp_path / "results.jsonl"
    rows = [ga.row("speedup", "6.10x / 5.36x = 1.14", "within 20%", True, "target H200 SXM"),
            ga.row("nccl", "exit 3, audit.json missing (None)", "audit written (exit 0 or 1)", False, "NCCL error")]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ga.main(["row", "fp8", "timed out after 90s", "false", "--results", str(results)]) == 0
    text = ga.table([json.loads(line) for line in results.read_text().splitlines()])
    body = {ln.split(" | ")[0][2:]: ln for ln in text.splitlines() if ln.startswith("| ") and "---" not in ln}
    assert body["speedup"].endswith("| within 20% | PASS |") and "target H200" not in body["speedup"]
    assert body["nccl"].endswith("| FAIL |") and "(NCCL error)" in body["nccl"]
    assert "timed out after 90s" in body["fp8"] and "_scaled_mm ran" in body["fp8"] and body["fp8"].endswith("FAIL |")
    assert "not measured (did not run (no row))" in body["dropout"]
    assert list(body)[1:] == [s for s, _, _ in ga.STEPS]  # in the script's order, header first
    assert text.rstrip().endswith(f"1 passed, 2 failed, {len(ga.STEPS) - 3} without a verdict")
    assert ga.main(["table", str(results)]) == 1  # a failed step fails the table


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_session_script_parses_and_the_checks_find_python3_alone(tmp_path):
    """A GPU image with only ``python3`` (a lent H200's): the dry run still runs, through PA_PYTHON."""
    assert subprocess.run(["bash", "-n", str(ROOT / "bench/gpu_session.sh")]).returncode == 0
    env = {"PATH": "/usr/bin:/bin", "PA_PYTHON": sys.executable}
    p = subprocess.run(["bash", str(ROOT / "bench/gpu_checks.sh"), "--dry-run"], capture_output=True, text=True,
                       env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.rstrip().endswith(f"0 passed, 0 failed, {len(ga.STEPS)} without a verdict")


def test_the_runtime_row_reads_the_paired_ratio_of_runtime_overhead():
    """The line bench/runtime_overhead.py printed on the H200 (2026-11-28), and one without it."""
    text = ("step                                    median ms   ratio\n"
            "apply_policy + controller.step              7.886  1.080x\n"
            "apply_policy + controller.step / baseline, paired per round: median 1.080x, 95% CI of the median "
            "1.064-1.105x, quartiles 1.019-1.174x\n")
    ratio, spread = ga.runtime_ratio(text)
    assert ratio == 1.080 and spread.startswith("95% CI of the median 1.064-1.105x")
    assert ga.runtime_ratio("Traceback (most recent call last):\n") is None
    assert [goal for _, _, goal in ga.RUNTIME_PROBES] == [1.10, 1.03]  # issue 33: 512 wide, 4096 wide
