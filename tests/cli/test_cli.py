"""The command line: exit codes, messages without tracebacks, the targets table."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from models import MLP, MLP_BATCH
from precision_audit.cli import main


def test_targets_lists_every_gpu(capsys):
    assert main(["targets"]) == 0
    out = capsys.readouterr().out
    for key in ("h100-sxm", "h100-pcie", "h200", "b200", "a100-40gb", "a100-80gb", "a10", "l4", "l40s", "t4",
                "v100-sxm2", "rtx-3090", "rtx-4090"):
        assert key in out


def test_audit_json_summary_on_stdout(tmp_path, capsys):
    code = main([MLP, "--batch", MLP_BATCH, "--out", str(tmp_path / "o"), "--json", "--quiet", "--steps", "0"])
    assert code == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert set(doc["summary"]) == {"fp32", "fp16", "bf16"}
    assert captured.err == "", "--quiet prints no progress"


def test_progress_goes_to_stderr_and_summary_to_stdout(tmp_path, capsys):
    assert main([MLP, "--batch", MLP_BATCH, "--out", str(tmp_path / "o"), "--steps", "0", "--formats", "bf16"]) == 0
    captured = capsys.readouterr()
    assert "[1] loading" in captured.err
    assert "bf16" in captured.out and "fp16 " not in captured.out.split("plan:")[0]


@pytest.mark.parametrize("args, words", [
    (["missing.py"], ["not found", "missing.py"]),
    ([MLP, "--batch", "nope.pt"], ["nope.pt"]),
    ([MLP, "--batch", MLP_BATCH, "--target", "h1000"], ["unknown", "h100-sxm"]),
    ([MLP, "--batch", MLP_BATCH, "--formats", "fp12"], ["unknown format", "bf16"]),
    ([MLP, "--batch", MLP_BATCH, "--budget", "speed=2"], ["--budget", "loss"]),
    ([MLP, "--batch", MLP_BATCH, "--formats", "bf16", "--target", "v100"], ["V100", "bf16"]),
    ([MLP, "--batch", MLP_BATCH, "--device", "cuda"], ["CUDA", "--device cpu"]),
    ([MLP, "--batch", MLP_BATCH, "--steps", "-1"], ["--steps"]),
])
def test_user_errors_exit_2_with_one_message(tmp_path, capsys, args, words):
    if "--device" in args:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    code = main(args + ["--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    for w in words:
        assert w in err, f"{w!r} missing from: {err}"
    assert not (tmp_path / "o").exists(), "nothing is written for a failed audit"


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    assert main([MLP, "--batch", MLP_BATCH, "--out", str(f)]) == 2
    assert "is a file" in capsys.readouterr().err
    assert f.read_text() == "x"


def test_python_dash_m_runs_and_exits_2_without_traceback(tmp_path):
    p = subprocess.run([sys.executable, "-m", "precision_audit", str(tmp_path / "none.py")],
                       capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "not found" in p.stderr


def test_failed_audit_keeps_previous_good_outputs(tmp_path):
    out = tmp_path / "o"
    assert main([MLP, "--batch", MLP_BATCH, "--out", str(out), "-q", "--steps", "0"]) == 0
    good = (out / "audit.json").read_bytes()
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\ndef build_model():\n    return torch.nn.Linear(3, 4)\n")
    assert main([str(bad), "--batch", MLP_BATCH, "--out", str(out), "-q"]) == 2
    assert (out / "audit.json").read_bytes() == good
