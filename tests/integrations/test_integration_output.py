"""What the trainer callbacks show (issue 35): the summary with Python's default logging (no
``logging.basicConfig``), once with a configured one, and no progress bar of the audit's own nested in the
trainer's; and ``precision_audit.audit`` in a Jupyter kernel without ipywidgets shows no "IProgress not found".

Each case runs in a fresh interpreter: logging's configuration is process-wide (pytest's own capture handler on
the root logger would hide the difference), as is tqdm's notebook detection at import."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT

# A fresh HOME has no compiled emulation kernels: without this each interpreter would build them (20-40 s)
NO_BUILD = {"PRECISION_AUDIT_AUTO_BUILD": "0"}

HF = """
import sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from precision_audit.integrations.transformers import PrecisionAuditCallback

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=8,
                                   bos_token_id=0, eos_token_id=0))
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 50, (4, 8))]
for run in RUNS:
    run()
    args = TrainingArguments(output_dir=OUT, max_steps=1, per_device_train_batch_size=2, report_to=[], use_cpu=True,
                             disable_tqdm=False)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[PrecisionAuditCallback(steps=0)]).train()
"""

LIGHTNING = """
import lightning as L
import torch
from torch import nn
from precision_audit.integrations.lightning import PrecisionAuditCallback

class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    def forward(self, x):
        return self.net(x)
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randint(0, 4, (16,)))
for run in RUNS:
    run()
    trainer = L.Trainer(max_steps=1, accelerator="cpu", default_root_dir=OUT, logger=False,
                        enable_checkpointing=False, callbacks=[PrecisionAuditCallback(steps=0)])
    trainer.fit(Classifier(), torch.utils.data.DataLoader(data, batch_size=8))
"""


# The same process trains twice: first with Python's default logging, then after logging.basicConfig (a
# marker line on stderr between the two).
RUNS = """
import logging, sys
def default():
    pass
def configured():
    print("=== basicConfig ===", file=sys.stderr, flush=True)
    logging.basicConfig(level=logging.INFO)
RUNS = [default, configured]
"""


@pytest.mark.parametrize("trainer", ["transformers", "lightning"])
def test_the_summary_is_shown_once_and_no_bar_is_nested(tmp_path, trainer):
    pytest.importorskip(trainer)
    script = f"OUT = {str(tmp_path / 'run')!r}\n" + textwrap.dedent(RUNS) + textwrap.dedent(
        HF if trainer == "transformers" else LIGHTNING)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT),
                               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **NO_BUILD})
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = "GPT2LMHeadModel" if trainer == "transformers" else "Classifier"
    for part in proc.stderr.split("=== basicConfig ==="):  # Python's default logging, then a configured one
        assert part.count(f"precision-audit: {model} (") == 1, part[-3000:]  # the summary's first line, once
        assert part.count(f"auditing {model} on the first training batch") == 1
        # the audit's own bar (precision_audit/api.py TqdmProgress) draws "precision-audit: <stage> [n stages, ...]"
        assert " stages, " not in part


KERNEL = """
# A plain Jupyter kernel without ipywidgets, as tqdm.autonotebook sees one: ipykernel's shell is imported and
# IPython answers get_ipython(); ipywidgets cannot be imported.
import sys, types, warnings
ipy, disp = types.ModuleType("IPython"), types.ModuleType("IPython.display")
class ZMQInteractiveShell:
    config = {"IPKernelApp": {}}
ipy.get_ipython = lambda: ZMQInteractiveShell()
disp.display = lambda *a, **k: None
ipy.display = disp
sys.modules.update({"IPython": ipy, "IPython.display": disp, "ipykernel": types.ModuleType("ipykernel"),
                    "ipykernel.zmqshell": types.ModuleType("ipykernel.zmqshell"), "ipywidgets": None})
import torch
from torch import nn
import precision_audit
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch.manual_seed(0)
    precision_audit.audit(nn.Sequential(nn.Linear(8, 8)), torch.randn(4, 8), steps=0)
print("WARNED:", [str(w.message)[:40] for w in caught if "IProgress" in str(w.message)])
with warnings.catch_warnings(record=True) as caught:  # the premise: tqdm takes this for a kernel without ipywidgets
    warnings.simplefilter("always")
    import tqdm.auto
print("TQDM.AUTO WARNS:", any("IProgress" in str(w.message) for w in caught))
"""


def test_no_ipywidgets_warning_in_a_plain_jupyter_kernel(tmp_path):
    proc = subprocess.run([sys.executable, "-c", KERNEL], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT), **NO_BUILD})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "WARNED: []" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "TQDM.AUTO WARNS: True" in proc.stdout, proc.stdout  # the premise: tqdm.auto itself would warn here
    assert "precision-audit" in proc.stderr and " stages, " in proc.stderr  # the text bar was drawn
