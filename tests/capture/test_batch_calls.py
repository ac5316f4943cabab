"""Calls on the batch itself take their local error from the format passes instead of a re-run (issue 14, P1).

A module whose every tensor argument is one of the batch's own tensors (the body of a Hugging Face model under
its task head, an encoder on the input features) gets the same inputs in every format pass, so its output there
*is* its re-run: capture/reference_pass.py (``BatchCall``) takes the local error, the first-order loss impact
and, at the second reduction order, the impact from those passes, and does not re-run it. The reference for
every figure is the re-run path itself (``Ranks.batch_calls = False``, capture/ranks.py): the same numbers, fewer
re-runs.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from precision_audit.capture import CaptureConfig, CaptureSession
from precision_audit.capture.noise import measure_noise_floor
from precision_audit.capture.ranks import Ranks
from precision_audit.capture.reference_pass import batch_call_note
from precision_audit.formats import Format

FORMATS = (Format.FP16, Format.BF16)
_RERUN = CaptureSession._rerun_once  # the real one (each capture below puts its own spy over it)


class Body(nn.Module):
    """Work of its own (a scaling and a tanh) around two layers, with dropout: a model's body."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(16, 32), nn.Linear(32, 16), nn.Dropout(0.25)

    def forward(self, x, scale=1.0):
        return torch.tanh(self.fc2(self.drop(torch.relu(self.fc1(x))))) * scale


class WithHead(nn.Module):
    """A task head over a body called on the batch; the body is called twice (both calls on the batch)."""

    def __init__(self, draw_in_low_precision: bool = False, fail_in: Format | None = None) -> None:
        super().__init__()
        self.body, self.head = Body(), nn.Linear(16, 4)
        self.draw_in_low_precision, self.fail_in = draw_in_low_precision, fail_in

    def forward(self, x):
        if self.draw_in_low_precision and torch.is_autocast_enabled("cpu"):
            torch.rand(7)  # a draw only the low-precision passes make: the body's random state differs there
        if self.fail_in is not None and torch.get_autocast_dtype("cpu") == {Format.FP16: torch.float16,
                                                                           Format.BF16: torch.bfloat16}[self.fail_in] \
                and torch.is_autocast_enabled("cpu"):
            raise RuntimeError("no low precision here")
        return self.head(self.body(x, scale=0.5) + self.body(x, scale=2.0))


def _capture(model, forward, loss_of, batch_calls: bool, monkeypatch):
    """The records and the noise floor of a whole capture, and the names of the modules re-run alone."""
    reruns: list[str] = []

    def spy(self, m, fmt, *a, **k):
        reruns.append(self._names[id(m)])
        return _RERUN(self, m, fmt, *a, **k)

    monkeypatch.setattr(CaptureSession, "_rerun_once", spy)
    monkeypatch.setattr(Ranks, "batch_calls", batch_calls)
    with CaptureSession(model, forward, loss_of, CaptureConfig(FORMATS)) as s:
        s.reference_run()
        for f in FORMATS:
            s.format_run(f)
        noise = measure_noise_floor(s, FORMATS)
        layers = {r.name: r for r in s.result().layers}
    return layers, noise, reruns


def _capture_on(model, x, batch_calls: bool, monkeypatch):
    model.train()
    return _capture(model, lambda m: m(x), lambda y: y.float().pow(2).mean(), batch_calls, monkeypatch)


def _figures(layers, noise):
    out = {}
    for name, rec in layers.items():
        for f, fs in rec.formats.items():
            e = fs.local
            local = None if e is None else (e.n, e.nonfinite, e.ref_nonfinite, e.sum_ref2, e.sum_diff2, e.sum_dot,
                                            e.sum_p2, e.max_abs)
            out[(name, f)] = (local, fs.local_note, fs.impact_measured, fs.loss_impact, fs.loss_impact_abs)
    return out, noise.impacts


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-300)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("draw_in_low_precision", [False, True])
def test_calls_on_the_batch_give_the_re_runs_figures_without_re_running(monkeypatch, draw_in_low_precision):
    torch.manual_seed(0)
    model, x = WithHead(draw_in_low_precision), torch.randn(8, 16) * 3
    new, noise_new, reruns_new = _capture_on(model, x, True, monkeypatch)
    old, noise_old, reruns_old = _capture_on(model, x, False, monkeypatch)
    (fig_new, imp_new), (fig_old, imp_old) = _figures(new, noise_new), _figures(old, noise_old)
    for key in fig_old:
        assert _same(fig_new[key], fig_old[key]), (key, fig_new[key], fig_old[key])
    assert _same(imp_new, imp_old)
    assert new["body"].formats[Format.BF16].local is not None and new["body"].formats[Format.BF16].impact_measured
    assert imp_new["body"][Format.FP16] is not None and imp_new["body"][Format.FP16] > 0
    # the re-run path re-runs the body (two calls, two formats, two orders); the new one only where the random
    # state before the call differs in the low-precision pass (then it re-runs it there, from the FP32 state)
    assert reruns_old.count("body") == 8
    assert reruns_new.count("body") == (8 if draw_in_low_precision else 0)
    assert reruns_old.count("body.fc1") == 8 and reruns_new.count("body.fc1") == (8 if draw_in_low_precision else 0)
    assert reruns_new.count("body.fc2") == reruns_old.count("body.fc2") == 8  # not on the batch: re-run as before


def test_a_hugging_face_body_is_measured_from_the_format_passes(monkeypatch):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=96, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 96, (2, 12))

    def run(batch_calls):
        layers, noise, reruns = _capture(model, lambda m: m(input_ids=ids, labels=ids), lambda o: o.loss,
                                         batch_calls, monkeypatch)
        return _figures(layers, noise), reruns

    (fig_new, imp_new), reruns_new = run(True)
    (fig_old, imp_old), reruns_old = run(False)
    for key in fig_old:
        assert _same(fig_new[key], fig_old[key]), (key, fig_new[key], fig_old[key])
    assert _same(imp_new, imp_old)
    assert "model" in reruns_old and "model" not in reruns_new  # the body under the task head
    assert fig_new[("model", Format.FP16)][0] is not None and imp_new["model"][Format.BF16] is not None
    # the body (every GEMM of the model but the head's) and the embedding: once per format and order before
    assert reruns_old.count("model") == reruns_old.count("model.embed_tokens") == 4
    assert "model.embed_tokens" not in reruns_new
    assert len(reruns_new) == len(reruns_old) - 8


def test_a_format_pass_that_fails_before_the_call_leaves_it_unmeasured_and_says_why(monkeypatch):
    torch.manual_seed(0)
    model, x = WithHead(fail_in=Format.FP16), torch.randn(8, 16)
    layers, _, _ = _capture_on(model, x, True, monkeypatch)
    fs = layers["body"].formats[Format.FP16]
    assert fs.local is None and not fs.impact_measured and fs.local_note == batch_call_note(Format.FP16)
    assert "did not reach it" in fs.local_note
    assert layers["body"].formats[Format.BF16].local is not None  # the other format is measured


class PooledIn3d(nn.Module):
    """The root's own op has no Half/BFloat16 CPU kernel: the fp16 pass fails there and is redone with the
    fp32-fallback dispatch mode (format_pass.py), after fc1 (on the batch) and fc2 (re-run) were measured."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc2(torch.relu(self.fc1(x)))
        return torch.nn.functional.avg_pool3d(y.view(2, 1, 2, 2, 8), 2)


def test_the_fp32_fallback_retry_keeps_the_re_runs_impacts_and_measures_the_batch_calls_again(monkeypatch):
    torch.manual_seed(0)
    model, x = PooledIn3d(), torch.randn(8, 8)
    monkeypatch.setattr(Ranks, "batch_calls", True)
    with CaptureSession(model, lambda m: m(x), lambda y: y.float().pow(2).mean(),
                        CaptureConfig((Format.FP16,))) as s:
        s.reference_run()
        fc2 = s.layers[id(model.fc2)].formats[Format.FP16]
        before = (fc2.local.sum_diff2, fc2.loss_impact, fc2.loss_impact_abs)
        assert fc2.impact_measured and before[2] > 0
        s.format_run(Format.FP16)
        assert s._use_gemm_mode, "the pass was redone with the fp32-fallback mode"
        assert s.runs[Format.FP16].error is None
        fc2 = s.layers[id(model.fc2)].formats[Format.FP16]
        assert fc2.impact_measured and (fc2.local.sum_diff2, fc2.loss_impact, fc2.loss_impact_abs) == before
        fc1 = s.layers[id(model.fc1)].formats[Format.FP16]
        assert fc1.local is not None and fc1.local_note is None and fc1.impact_measured
        assert fc1.calls == 1  # measured once, in the redone pass (not merged with the failed attempt's)
        assert fc1.local.n == 64
