"""``precision_audit.audit(model, batch)``: the live-object audit (README.md, "From Python", "In a notebook").

- it writes the same audit.json as the file-based audit of the same model and batch, apart from the fields that
  name the run (listed in RUN_FIELDS, with why);
- the model is bit-identical afterwards (parameters, buffers, gradients, requires_grad, modes, hooks, RNG);
- every batch shape of a BATCH file works, bad arguments raise one AuditError before anything runs;
- the result's summary / to_html / save / _repr_html_ (valid, self-contained HTML, text escaped).
"""

from __future__ import annotations

import html.parser
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import precision_audit
from conftest import ROOT
from precision_audit.audit import AuditOptions, run_audit
from precision_audit.errors import AuditError, BatchError, LossError, ModelLoadError, OptionError, OutputError
from precision_audit.loading import load_model
from precision_audit.report.terminal import summary_text

MLP = ROOT / "sample_models" / "mlp"

#: audit.json fields that differ between the file-based and the live audit of the same model and batch, and why:
RUN_FIELDS = {
    ("created",): "the time of each run",
    ("options", "model"): "the MODEL path vs 'MLP object passed to audit()'",
    ("options", "batch"): "the BATCH path vs None (no file)",
    ("options", "out"): "each run's own folder",
    ("model", "source"): "'build_model in model.py' vs 'MLP object passed to audit()'",
    ("batch", "source"): "the BATCH path vs 'audit(batch=...)'",
}
# (noise_floor.planner_impacts_wall_s, the wall time of the second-order reference pass, is null here: the MLP's
# decisions need no second order but the FP32 noise floor; docs/plan.md, "Noise floor")


def _drop(audit: dict, paths) -> dict:
    audit = json.loads(json.dumps(audit))
    for path in paths:
        d = audit
        for key in path[:-1]:
            d = d[key]
        d.pop(path[-1])
    return audit


def test_live_audit_equals_the_file_based_audit(tmp_path):
    file_result = run_audit(AuditOptions(model=str(MLP / "model.py"), batch=str(MLP / "sample.pt"),
                                         out=tmp_path / "file", steps=0))
    model, _ = load_model(str(MLP / "model.py"))
    batch = torch.load(MLP / "sample.pt", weights_only=True)
    live = precision_audit.audit(model, batch, out=tmp_path / "live", steps=0, progress=False)

    file_json = json.loads((tmp_path / "file" / "audit.json").read_text())
    live_json = json.loads((tmp_path / "live" / "audit.json").read_text())
    assert live_json == live.audit
    for path in RUN_FIELDS:  # the run fields really are there, and really differ
        a, b = file_json, live_json
        for key in path:
            a, b = a[key], b[key]
        assert a != b or path == ("created",), path  # two runs may fall in the same second
    assert _drop(file_json, RUN_FIELDS) == _drop(live_json, RUN_FIELDS)
    assert live_json["batch"]["source"] == "audit(batch=...)"
    assert live_json["options"]["out"] == str(tmp_path / "live")
    assert (tmp_path / "file" / "policy.json").read_text() == (tmp_path / "live" / "policy.json").read_text()
    file_names = sorted(p.relative_to(tmp_path / "file").parts[0] for p in file_result.files)
    live_names = sorted(p.relative_to(tmp_path / "live").parts[0] for p in live.files)
    assert file_names == live_names == ["audit.json", "policy.json", "report.html", "tb"]
    assert live.exit_code == file_result.exit_code == 0


class _Net(nn.Module):
    """BatchNorm (buffers a forward changes), dropout (random), a frozen layer and an eval-mode submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.3)
        self.frozen = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.head(self.frozen(self.drop(torch.relu(self.bn(self.fc1(x))))))


def _snapshot(model: nn.Module) -> dict:
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "grads": {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
        "hooks": {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks))
                  for n, m in model.named_modules()},
        "dicts": {n: sorted(m.__dict__) for n, m in model.named_modules()},
        "ids": {k: id(v) for k, v in model.state_dict(keep_vars=True).items()},
        "rng": torch.get_rng_state(),
        "dtypes_devices": {k: (v.dtype, v.device) for k, v in model.state_dict().items()},
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool(
            torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                        b.view(torch.uint8) if b.is_floating_point() else b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_model_is_bit_identical_afterwards():
    torch.manual_seed(3)
    model = _Net()
    model.head.eval()  # a submodule in another mode than its parent stays so
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    torch.nn.functional.cross_entropy(model(x), y).backward()  # gradients the audit must not touch
    calls = []
    model.fc1.register_forward_hook(lambda m, i, o: calls.append(1))
    before = _snapshot(model)
    x_before = x.clone()
    result = precision_audit.audit(model, (x, y), steps=0, formats="bf16", progress=False)
    after = _snapshot(model)
    for key in before:
        assert _same(before[key], after[key]), key
    assert torch.equal(x, x_before)
    assert result.audit["model"]["training"] is True and result.audit["loss"]["kind"] == "cross_entropy"
    # The audit ran: BatchNorm's running statistics did change in its own copy, so keeping them is not trivial.
    assert len(calls) > 0  # the user's hook ran on the audit's copy, and is still registered on the model
    assert model.fc1._forward_hooks


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)


class _TinyKw(_Tiny):
    def forward(self, x, scale=None):
        out = self.fc(x)
        return out if scale is None else out * scale


@pytest.mark.parametrize("make_batch, names, loss", [
    (lambda x, y: x, ["args[0]"], "surrogate"),
    (lambda x, y: (x, y), ["args[0]", "target"], "cross_entropy"),
    (lambda x, y: [x, y], ["args[0]", "target"], "cross_entropy"),
    (lambda x, y: {"x": x, "scale": torch.tensor(2.0)}, ["x", "scale"], "surrogate"),
])
def test_batch_shapes_as_a_batch_file(make_batch, names, loss):
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    model = _TinyKw() if isinstance(make_batch(x, y), dict) else _Tiny()
    r = precision_audit.audit(model, make_batch(x, y), steps=0, formats=["bf16"], progress=False)
    assert [t["name"] for t in r.audit["batch"]["tensors"]] == names
    assert r.audit["loss"]["kind"] == loss
    assert r.files == []  # nothing saved without out=


def test_loss_fn_gets_the_batch_as_given():
    seen = []

    def loss_fn(output, batch):
        seen.append(type(batch).__name__)
        return (output.float() - batch["target"]).pow(2).mean()

    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x, **unused):
            return self.fc(x)

    batch = {"x": torch.randn(4, 8), "target": torch.randn(4, 4)}
    r = precision_audit.audit(Net(), batch, loss_fn=loss_fn, steps=0, formats="bf16", progress=False)
    assert r.audit["loss"]["kind"] == "loss_fn" and seen and set(seen) == {"dict"}


@pytest.mark.parametrize("kwargs, error, text", [
    (dict(model=nn.Linear, batch=torch.randn(2, 2)), ModelLoadError, "torch.nn.Module"),
    (dict(model={"fc.weight": torch.zeros(2)}, batch=torch.randn(2, 2)), ModelLoadError, "torch.nn.Module"),
    (dict(model=nn.Linear(2, 2), batch=None), BatchError, "needs a batch"),
    (dict(model=nn.Linear(2, 2), batch="x.pt"), BatchError, "holds no tensor"),
    (dict(model=nn.Linear(2, 2), batch=(torch.randn(2, 2),) * 3), BatchError, "takes 1 positional input"),
    (dict(model=nn.Linear(2, 2), batch=torch.full((2, 2), float("nan"))), BatchError, "non-finite"),
    (dict(model=nn.Linear(2, 2).requires_grad_(False), batch=torch.randn(2, 2)), ModelLoadError, "requires grad"),
    (dict(model=nn.ReLU(), batch=torch.randn(2, 2)), ModelLoadError, "no parameters"),
    (dict(model=nn.Linear(2, 2), batch=torch.randn(2, 2), loss_fn="mse"), LossError, "not callable"),
    (dict(model=nn.Linear(2, 2), batch=torch.randn(2, 2), budget=0.1), OptionError, "budget"),
    (dict(model=nn.Linear(2, 2), batch=torch.randn(2, 2), budget={"max_loss": 1}), OptionError, "budget field"),
    (dict(model=nn.Linear(2, 2), batch=torch.randn(2, 2), budget={"max_loss_rel_change": -1}), OptionError,
     "out of range"),
    (dict(model=nn.Linear(2, 2), batch=torch.randn(2, 2), progress="yes"), OptionError, "progress"),
    (dict(model=nn.Linear(2, 2), batch=torch.randn(2, 2), formats="fp7"), OptionError, "fp7"),
    (dict(model=nn.Linear(2, 2), batch=torch.randn(2, 2), target="z80"), AuditError, "z80"),
    (dict(model=nn.Linear(2, 2), batch=torch.randn(2, 2), out=""), OptionError, "out"),
])
def test_bad_arguments_raise_one_clear_error(kwargs, error, text):
    model = kwargs.pop("model")
    batch = kwargs.pop("batch")
    with pytest.raises(error) as e:
        precision_audit.audit(model, batch, steps=0, **{"progress": False, **kwargs})
    assert text in str(e.value), str(e.value)


def test_out_that_is_a_file_is_refused_before_the_run(tmp_path):
    (tmp_path / "f").write_text("keep")
    calls = []
    model = nn.Linear(2, 2)
    model.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(OutputError):
        precision_audit.audit(model, torch.randn(2, 2), out=tmp_path / "f", progress=False)
    assert calls == [] and (tmp_path / "f").read_text() == "keep"


def test_failing_loss_fn_leaves_the_model_as_it_was():
    model, x = _Net(), torch.randn(4, 8)
    before = _snapshot(model)

    def loss_fn(output, batch):
        raise KeyError("labels")

    with pytest.raises(LossError, match="loss_fn"):
        precision_audit.audit(model, x, loss_fn=loss_fn, steps=0, progress=False)
    after = _snapshot(model)
    assert [k for k in before if not _same(before[k], after[k])] == []


class _Strict(html.parser.HTMLParser):
    """Fails on an end tag that closes another element than the last one opened; collects text and URLs."""

    VOID = {"br", "hr", "img", "meta", "link", "input", "col", "wbr"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.text: list[str] = []
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:] or 'nothing'}"
        self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def test_repr_html_is_valid_self_contained_and_escaped(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("<script>alert(1)</script>", nn.Linear(8, 8))
    model.add_module("head", nn.Linear(8, 4))
    r = precision_audit.audit(model, (torch.randn(8, 8), torch.randint(0, 4, (8,))), steps=0, progress=False)
    fragment = r._repr_html_()
    p = _Strict()
    p.feed(fragment)
    p.close()
    assert p.stack == [], f"unclosed: {p.stack}"
    text = "".join(p.text)
    assert "<script>alert(1)</script>" in text  # the module name, shown as text...
    assert [t for t, _ in p.tags].count("script") == 0  # ...never as an element
    assert "http://" not in fragment and "https://" not in fragment and "src=" not in fragment
    assert r.audit["verdict"]["message"] in text
    assert [t for t, _ in p.tags].count("details") >= 1
    for f in ["fp32", *r.audit["formats"]]:
        assert f in text
    assert "not saved" in text
    r.save(tmp_path / "saved")
    assert "audit.json" in r._repr_html_()


def test_result_methods_match_the_command_line(tmp_path):
    torch.manual_seed(0)
    r = precision_audit.audit(_Tiny(), (torch.randn(4, 8), torch.randint(0, 4, (4,))), steps=0, formats="bf16",
                              progress=False, budget={"max_loss_rel_change": 0.5})
    assert r.audit["options"]["budget"] == {"max_loss_rel_change": 0.5, "max_output_rel_error": 0.05}
    assert r.summary() == summary_text(r.audit)
    page = r.to_html()
    assert page.lstrip().lower().startswith("<!doctype html") and r.html is page
    files = r.save(tmp_path / "a")
    assert files == r.files and files[:3] == [tmp_path / "a" / n for n in ("audit.json", "policy.json",
                                                                           "report.html")]
    saved = json.loads((tmp_path / "a" / "audit.json").read_text())
    assert saved == r.audit and saved["options"]["out"] == str(tmp_path / "a")
    assert (tmp_path / "a" / "report.html").read_text() == r.to_html()
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".precision-audit")]
    assert r.exit_code == r.audit["verdict"]["exit_code"]
    assert "AuditResult _Tiny" in repr(r)


def test_progress_uses_tqdm_auto(monkeypatch):
    import tqdm.auto
    import tqdm.std

    bars = []

    class FakeBar:
        def __init__(self, **kwargs):
            self.descs, self.n, self.closed = [], 0, False
            bars.append(self)

        def set_description_str(self, s, refresh=True):
            self.descs.append(s)

        def update(self, n=1):
            self.n += n

        def close(self):
            self.closed = True

    monkeypatch.setattr(tqdm.auto, "tqdm", FakeBar)
    # without ipywidgets the bar is tqdm.std's (tqdm.auto would warn "IProgress not found" in a notebook first)
    monkeypatch.setattr(tqdm.std, "tqdm", FakeBar)
    torch.manual_seed(0)
    precision_audit.audit(_Tiny(), torch.randn(4, 8), steps=0, formats="bf16")
    assert len(bars) == 1 and bars[0].closed and bars[0].n >= 3
    assert any("bf16 pass" in d for d in bars[0].descs)
    messages = []
    precision_audit.audit(_Tiny(), torch.randn(4, 8), steps=0, formats="bf16", progress=messages.append)
    assert any("FP32 reference" in m for m in messages) and len(bars) == 1


def test_audit_is_lazy_and_callable():
    code = ("import sys, precision_audit; assert 'torch' not in sys.modules; "
            "import precision_audit.audit as m; from precision_audit import audit; "
            "assert m is audit and callable(audit) and m.run_audit; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_a_wrapped_model_is_audited_as_the_model_inside():
    torch.manual_seed(0)
    inner = _Tiny()
    r = precision_audit.audit(nn.DataParallel(inner), torch.randn(4, 8), steps=0, formats="bf16", progress=False)
    assert r.audit["model"]["class"] == "_Tiny"
    r.policy.check_model(inner)  # the policy names the inner model's modules


def test_repr_html_renders_in_a_browser(tmp_path):
    """The fragment in headless Chromium (as a notebook shows it, inside a page): no console error, no request,
    the per-layer table collapsed until its summary is clicked."""
    # the browser helpers of the report's tests, wherever the tests' layout keeps them
    here = next(Path(__file__).resolve().parent.rglob("test_report_browser.py")).parent
    if str(here) not in sys.path:
        sys.path.insert(0, str(here))
    from test_report_browser import CHROMIUM, Chromium

    if not Path(CHROMIUM).exists():
        pytest.skip(f"headless Chromium not available: {CHROMIUM} is missing (.ci/run installs it)")
    torch.manual_seed(0)
    r = precision_audit.audit(_Tiny(), (torch.randn(4, 8), torch.randint(0, 4, (4,))), steps=0, progress=False)
    page = tmp_path / "cell.html"
    page.write_text("<!DOCTYPE html><html><head><meta charset='utf-8'><title>cell</title></head><body>"
                    + r._repr_html_() + "</body></html>", encoding="utf-8")
    b = Chromium(tmp_path / "profile")
    try:
        b.open(page)
        assert b.errors() == []
        assert b.eval("performance.getEntriesByType('resource').length") == 0  # nothing fetched
        assert b.eval("document.querySelectorAll('.pa-nb table').length") >= 2
        shown = "document.querySelector('.pa-nb details table').checkVisibility()"
        assert b.eval("document.querySelector('.pa-nb details').open") is False and b.eval(shown) is False
        b.click(".pa-nb details summary")
        assert b.eval("document.querySelector('.pa-nb details').open") is True and b.eval(shown) is True
        assert b.eval("document.querySelector('.pa-nb .v').textContent").startswith(r.audit["verdict"]["message"])
    finally:
        b.close()


def test_save_writes_the_profiler_traces_of_the_timed_steps(tmp_path):
    torch.manual_seed(0)
    r = precision_audit.audit(_Tiny(), torch.randn(4, 8), steps=1, formats="bf16", progress=False, trace=True)
    traces = r.audit["traces"]["files"]
    assert traces and r.files == []
    r.save(tmp_path / "t")
    for name in traces:
        assert (tmp_path / "t" / name).stat().st_size > 0
        assert tmp_path / "t" / name in r.files
