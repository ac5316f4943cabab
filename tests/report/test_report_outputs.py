"""An --out folder holds one audit's files: profiler traces of an earlier audit do not pile up in tb/<format>/
(issue 18 item 6; precision_audit/audit.py ``_write_outputs``)."""

from __future__ import annotations

import torch

import precision_audit


def _tiny_audit(steps: int = 1):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return precision_audit.audit(model, torch.randn(8, 16), loss_fn=lambda out, b: out.float().pow(2).mean(),
                                 progress=False,
                                 steps=steps, formats=["bf16"], trace=True)


def _traces(out):
    return sorted(p.relative_to(out).as_posix() for p in (out / "tb").rglob("*.pt.trace.json"))


def test_a_second_audit_into_the_same_out_replaces_the_first_ones_traces(tmp_path):
    result = _tiny_audit()
    result.save(tmp_path)
    before = _traces(tmp_path)
    assert before and {p.split("/")[1] for p in before} == {"fp32", "bf16"}, before

    # A later audit's traces carry new timestamps in their names (torch's trace handler): rename them so.
    result.traces = {k.replace(".pt.trace.json", ".later.pt.trace.json"): v for k, v in result.traces.items()}
    # ... and an audit of an older run left a format this one does not have
    stale = tmp_path / "tb" / "fp16" / "precision-audit-fp16.123.pt.trace.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    mine = tmp_path / "tb" / "fp16" / "my_notes.txt"  # not the audit's: left alone
    mine.write_text("keep")
    result.save(tmp_path)
    after = _traces(tmp_path)
    assert len(after) == len(before), after
    assert all(".later." in p for p in after), after
    assert not stale.exists() and mine.read_text() == "keep"
