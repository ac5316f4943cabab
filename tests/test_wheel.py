"""The built wheel carries the report templates and schemas: installed into a fresh venv, it renders a report."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

from conftest import ROOT


def test_wheel_in_fresh_venv_renders_a_report(tmp_path):
    dist = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(dist), str(ROOT)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    wheel = next(dist.glob("precision_audit-*.whl"))
    with zipfile.ZipFile(wheel) as zf:  # build-kernels compiles this source from the installed package
        assert "precision_audit/emulation/_emulation_kernels.cpp" in zf.namelist()
        # the JSON Schemas the record's codec checks audit.json (and the policy loader policy.json) against
        assert {"precision_audit/record/schemas/audit.schema.json",
                "precision_audit/record/schemas/policy.schema.json"} <= set(zf.namelist())

    env_dir = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    # torch and the other dependencies come from this test run's environment, as plain path entries: the
    # editable install of precision_audit lives there as a .pth hook, which a path entry does not run.
    purelib = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                           text=True).strip())
    (purelib / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    inst = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                          capture_output=True, text=True)
    assert inst.returncode == 0, inst.stderr

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.check_output([str(py), "-c", "import precision_audit; print(precision_audit.__file__)"],
                                    text=True, cwd=work, env=env).strip()
    assert str(purelib) in where, f"precision_audit imported from {where}, not from the installed wheel"
    model = ROOT / "sample_models" / "mlp"
    run = subprocess.run([str(env_dir / "bin" / "precision-audit"), str(model / "model.py"), "--batch",
                          str(model / "sample.pt"), "--out", str(work / "audit"), "--quiet", "--steps", "0"],
                         capture_output=True, text=True, cwd=work, env=env)
    assert run.returncode == 0, run.stderr
    html = (work / "audit" / "report.html").read_text()
    assert "<table" in html and "Mixed-precision audit" in html
    assert json.loads((work / "audit" / "audit.json").read_text())["schema"] == "precision-audit/audit"
