"""Exporters (`precision-audit export POLICY --to ...`): each output uses only its target's documented keys and
values, says what it cannot express, and the generated Python runs (FSDP for real on a one-process gloo group;
Lightning / Accelerate against recording stand-ins, and against the real libraries where they are installed)."""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import types
from pathlib import Path

import pytest
import torch

from precision_audit.cli.export import export_main
from precision_audit.errors import OptionError, PolicyError
from precision_audit.export import EXPORT_TARGETS, export_policy
from precision_audit.policy import LossScaling, ModuleOverride, Policy, fingerprint, model_layout, save_policy

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())  # the repository
sys.path.insert(0, str(ROOT / "sample_models" / "fp16_trouble"))
import model as fp16_trouble  # noqa: E402

# Documented keys (DeepSpeed docs "Configuration JSON", FP16 and BF16 training options; DeepSpeed 0.19
# runtime/precision_config.py DeepSpeedFP16Config / DeepSpeedBF16Config, which forbid any other key).
DEEPSPEED_FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                       "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"}
DEEPSPEED_BF16_KEYS = {"enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                       "bf16_optimizer_states"}
# lightning.fabric.connector._PRECISION_INPUT_STR (Lightning 2.x) and accelerate.utils.PrecisionType.
LIGHTNING_PRECISIONS = {"transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true",
                        "bf16-mixed", "32-true", "64-true"}
ACCELERATE_PRECISIONS = {"no", "fp8", "fp16", "bf16"}


def policy_for(default: str, overrides: dict[str, str] | None = None, *, init_scale: float = 131072.0,
               scaling: bool = True, tf32: bool = False) -> Policy:
    m = fp16_trouble.build_model()
    fp, n = fingerprint(m)
    return Policy(model_class="FP16Trouble", model_fingerprint=fp, model_modules=n, target_name="V100 SXM2",
                  target_compute_capability=(7, 0), default_format=default,
                  modules={k: ModuleOverride(v, f"reason for {k}") for k, v in (overrides or {}).items()},
                  loss_scaling=LossScaling(enabled=scaling, init_scale=init_scale), tf32_matmul=tf32,
                  tf32_cudnn=tf32, model_layout=model_layout(m))


POLICIES = {
    "fp16+hot": policy_for("fp16", {"hot": "fp32"}),
    "bf16": policy_for("bf16", scaling=False),
    "bf16+fp16-head": policy_for("bf16", {"head": "fp16", "faint": "fp32"}),
    "fp32+bf16-faint": policy_for("fp32", {"faint": "bf16"}, scaling=False, tf32=True),
    "tf32": policy_for("tf32", scaling=False),
    "fp16-odd-scale": policy_for("fp16", init_scale=3000.0),
    "fp16-no-scaling": policy_for("fp16", scaling=False),
}


# -- DeepSpeed ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", POLICIES)
def test_deepspeed_uses_documented_keys_only(name):
    p = POLICIES[name]
    out = export_policy(p, "deepspeed")
    cfg = json.loads(out.text)
    assert out.suffix == ".json"
    assert set(cfg) <= {"fp16", "bf16", "precision_audit"}
    assert set(cfg.get("fp16", {})) <= DEEPSPEED_FP16_KEYS
    assert set(cfg.get("bf16", {})) <= DEEPSPEED_BF16_KEYS
    assert cfg["precision_audit"]["cannot_express"] == list(out.notes)
    whole = p.effective_format("")
    assert cfg.get("fp16", {}).get("enabled", False) == (whole == "fp16")
    assert cfg.get("bf16", {}).get("enabled", False) == (whole == "bf16")
    for module in p.modules:
        assert any(module in n for n in out.notes), f"{module} must be listed as not expressible"


def test_deepspeed_fp16_block_carries_the_loss_scaling():
    p = POLICIES["fp16+hot"]
    fp16 = json.loads(export_policy(p, "deepspeed").text)["fp16"]
    assert fp16 == {"enabled": True, "loss_scale": 0, "initial_scale_power": 17, "loss_scale_window": 2000,
                    "hysteresis": 2, "min_loss_scale": 1}
    assert 2 ** fp16["initial_scale_power"] == p.loss_scaling.init_scale
    odd = export_policy(POLICIES["fp16-odd-scale"], "deepspeed")
    assert json.loads(odd.text)["fp16"]["initial_scale_power"] == round(math.log2(3000))
    assert any("not a power of two" in n for n in odd.notes)
    static = json.loads(export_policy(POLICIES["fp16-no-scaling"], "deepspeed").text)["fp16"]
    assert static == {"enabled": True, "loss_scale": 1.0}


def test_deepspeed_config_parses_with_deepspeed_itself():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    for name, p in POLICIES.items():
        cfg = json.loads(export_policy(p, "deepspeed").text)
        c = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, **cfg})
        assert c.float16_config.enabled == ("fp16" in cfg and cfg["fp16"]["enabled"]), name


# -- Python snippets -----------------------------------------------------------------------------------------

class Recorder:
    """A stand-in class recording how it was called."""

    calls: list

    def __init__(self, *args, **kwargs):
        type(self).calls.append((args, kwargs))
        self.args, self.kwargs = args, kwargs


def fake_modules(monkeypatch) -> dict[str, type]:
    made = {}
    for mod_name, cls_names in {"lightning": ["Trainer"], "lightning.pytorch": [],
                                "lightning.pytorch.plugins": ["MixedPrecision"], "accelerate": ["Accelerator"],
                                "accelerate.utils": ["GradScalerKwargs"]}.items():
        mod = types.ModuleType(mod_name)
        for c in cls_names:
            made[c] = type(c, (Recorder,), {"calls": []})
            setattr(mod, c, made[c])
        monkeypatch.setitem(sys.modules, mod_name, mod)
    return made


def run_snippet(text: str) -> dict:
    ns: dict = {"__name__": "exported"}
    exec(compile(text, "<exported>", "exec"), ns)
    return ns


@pytest.fixture
def policy_file(tmp_path):
    def write(p: Policy) -> str:
        path = tmp_path / "policy.json"
        save_policy(p, path)
        return str(path)
    return write


@pytest.mark.parametrize("name", POLICIES)
def test_lightning_snippet(name, monkeypatch, policy_file):
    p = POLICIES[name]
    made = fake_modules(monkeypatch)
    scaler_cls = type("GradScaler", (Recorder,), {"calls": []})
    monkeypatch.setattr(torch.amp, "GradScaler", scaler_cls)  # torch.amp.GradScaler("cuda") disables itself on CPU
    out = export_policy(p, "lightning", policy_path=policy_file(p))
    assert out.suffix == ".py"
    for n in out.notes:
        assert n[:60] in out.text, "every note is written into the file"
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        ns = run_snippet(out.text)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == \
            ((True, True) if p.default_format == "tf32" else (p.tf32_matmul, p.tf32_cudnn))
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    kw = ns["trainer_kwargs"]
    if p.default_format == "fp16":
        ((args, kwargs),) = made["MixedPrecision"].calls
        assert args == ("16-mixed", "cuda")
        ls = p.loss_scaling
        assert kwargs["scaler"].args == ("cuda",) and kwargs["scaler"].kwargs == {
            "init_scale": ls.init_scale, "growth_factor": ls.growth_factor, "backoff_factor": ls.backoff_factor,
            "growth_interval": ls.growth_interval, "enabled": ls.enabled}
        assert kw == {"plugins": [ns["precision_plugin"]]}
    else:
        assert kw["precision"] in LIGHTNING_PRECISIONS
        assert kw["precision"] == {"bf16": "bf16-mixed", "fp32": "32-true", "tf32": "32-true"}[p.default_format]
    model = fp16_trouble.build_model()
    handle = ns["apply_precision_policy"](model)
    assert handle.modules == {k: o.format for k, o in p.modules.items()}
    handle.remove()


@pytest.mark.parametrize("name", POLICIES)
def test_accelerate_snippet(name, monkeypatch, policy_file):
    p = POLICIES[name]
    made = fake_modules(monkeypatch)
    out = export_policy(p, "accelerate", policy_path=policy_file(p))
    ns = run_snippet(out.text)
    kw = ns["accelerator_kwargs"]
    assert kw["mixed_precision"] in ACCELERATE_PRECISIONS
    if p.default_format == "fp16":
        ((_, scaler_kw),) = made["GradScalerKwargs"].calls
        ls = p.loss_scaling
        assert scaler_kw == {"init_scale": ls.init_scale, "growth_factor": ls.growth_factor,
                             "backoff_factor": ls.backoff_factor, "growth_interval": ls.growth_interval,
                             "enabled": ls.enabled}
    else:
        assert "kwargs_handlers" not in kw
    handle = ns["apply_precision_policy"](fp16_trouble.build_model())
    assert set(handle.modules) == set(p.modules)
    handle.remove()


def test_lightning_and_accelerate_snippets_with_the_real_libraries(policy_file):
    pytest.importorskip("lightning")
    pytest.importorskip("accelerate")
    import lightning as L
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # a Trainer earlier in the session (tests/integrations) leaves accelerate's process-wide state set, and a new
    # Accelerator with another mixed_precision then refuses to start
    AcceleratorState._reset_state(reset_partial_state=True)
    p = POLICIES["bf16+fp16-head"]
    path = policy_file(p)
    ns = run_snippet(export_policy(p, "lightning", policy_path=path).text)
    L.Trainer(**ns["trainer_kwargs"], accelerator="cpu", logger=False, enable_checkpointing=False)
    ns = run_snippet(export_policy(p, "accelerate", policy_path=path).text)
    assert Accelerator(**ns["accelerator_kwargs"], cpu=True).mixed_precision == "bf16"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "tf32": torch.float32}


def _policy_step(model, children, x, y, enter) -> tuple[float, dict[str, torch.dtype]]:
    """One forward and backward of fp16_trouble under CUDA's autocast op policy (emulated on the CPU:
    capture/emulation.py) and ``enter()``'s context; returns the loss and the output dtype of each of ``children``
    (its top-level modules, taken before any FSDP wrapper renamed them)."""
    from precision_audit.capture.emulation import CudaAutocastPolicy

    seen: dict[str, torch.dtype] = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, n=n: seen.__setitem__(n, o.dtype))
             for n, m in children.items()]
    try:
        with CudaAutocastPolicy(), enter():
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    return float(loss.detach()), seen


@pytest.mark.parametrize("name", ["fp16+hot", "bf16+fp16-head", "fp32+bf16-faint"])
def test_fsdp_snippet_reproduces_the_policy_on_a_one_process_group(name, policy_file):
    """The generated FSDP1 and FSDP2 helpers, run (gloo, world size 1, CPU, CUDA's autocast op policy emulated):
    each overridden module outputs its own format's dtype and the loss is the runtime's (apply_policy + autocast
    without FSDP) to fp16 rounding of the parameters. On the V100 policy (fp16, 'hot' kept in fp32 for its 2e5
    outputs) the FSDP2 code cast hot's output back to fp16 (output_dtype): inf, and a NaN loss."""
    import warnings

    import torch.distributed as dist

    import precision_audit as pa

    p = POLICIES[name]
    out = export_policy(p, "fsdp", policy_path=policy_file(p))
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ns = run_snippet(out.text)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    mp = ns["mixed_precision"]
    whole = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(p.default_format)
    if whole is None:
        assert mp is None
    else:
        assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == (whole, torch.float32, torch.float32)
    assert ns["MODULE_FORMATS"] == {n: _DTYPE[o.format] for n, o in p.modules.items()}
    formats = {p.default_format, *[o.format for o in p.modules.values()]}
    assert (ns["scaler"] is not None) == (p.loss_scaling.enabled or "fp16" in formats)
    x, y = fp16_trouble.sample_batch()
    plain = fp16_trouble.build_model()
    handle = pa.apply_policy(plain, p)
    try:
        expected, expected_dtypes = _policy_step(plain, dict(plain.named_children()), x, y,
                                                 lambda: pa.autocast(p, "cpu"))
    finally:
        handle.remove()
    assert math.isfinite(expected)
    want = {n: _DTYPE[o.format] for n, o in p.modules.items()}
    assert {n: expected_dtypes[n] for n in want} == want
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m1, m2 = fp16_trouble.build_model(), fp16_trouble.build_model()
            models = {"fsdp1": (ns["wrap_fsdp1"](m1, device_id=torch.device("cpu")), dict(m1.named_children())),
                      "fsdp2": (ns["shard_fsdp2"](m2), dict(m2.named_children()))}
        for kind, (model, children) in models.items():
            loss, dtypes = _policy_step(model, children, x, y, lambda: ns["forward_autocast"]("cpu"))
            assert {n: dtypes[n] for n in want} == want, kind  # 'hot' stays fp32: no cast back to fp16
            # the parameters of the model's own unit are gathered in its dtype (fp16: ~3 digits)
            assert loss == pytest.approx(expected, rel=2e-2), kind
    finally:
        for h in ns["HANDLES"]:
            h.remove()
        dist.destroy_process_group()


# -- the command -------------------------------------------------------------------------------------------

def test_export_command_to_stdout_and_to_a_file(tmp_path, capsys, policy_file):
    path = policy_file(POLICIES["fp16+hot"])
    assert export_main([path, "--to", "deepspeed"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["fp16"]["initial_scale_power"] == 17 and cap.err == ""
    out = tmp_path / "cfg" / "lightning_precision.py"
    assert export_main([path, "--to", "lightning", "--out", str(out)]) == 0
    cap = capsys.readouterr()
    assert cap.out == "" and "wrote lightning settings" in cap.err and "note: " in cap.err and "hot" in cap.err
    compile(out.read_text(), str(out), "exec")
    for target in EXPORT_TARGETS:
        assert export_main([path, "--to", target, "--out", str(tmp_path / f"x.{target}")]) == 0


def test_export_command_user_errors(tmp_path, capsys, policy_file):
    path = policy_file(POLICIES["bf16"])
    with pytest.raises(SystemExit) as e:
        export_main([path, "--to", "megatron"])
    assert e.value.code == 2 and "invalid choice: 'megatron'" in capsys.readouterr().err
    with pytest.raises(PolicyError, match="no policy file"):
        export_main([str(tmp_path / "missing.json"), "--to", "fsdp"])
    (tmp_path / "bad.json").write_text('{"schema": "precision-audit/policy", "version": 7}')
    with pytest.raises(PolicyError, match="'version' is 7"):
        export_main([str(tmp_path / "bad.json"), "--to", "fsdp"])
    with pytest.raises(OptionError):
        export_policy(POLICIES["bf16"], "megatron")


# -- the Lightning and Accelerate snippets, run for real (issue 32) ------------------------------------------

def _dtypes_seen(model: torch.nn.Module, names) -> dict[str, list[torch.dtype]]:
    seen: dict[str, list[torch.dtype]] = {n: [] for n in names}
    for n in names:
        model.get_submodule(n).register_forward_hook(lambda m, i, o, n=n: seen[n].append(o.dtype))
    return seen


def test_lightning_snippet_trains_each_module_in_its_format(tmp_path, policy_file):
    """bf16 default, 'head' in fp16, 'faint' in fp32: the snippet's trainer_kwargs and apply_precision_policy() in
    configure_model() train every step with head's output fp16, faint's fp32 and hot's bf16, finite losses."""
    L = pytest.importorskip("lightning")
    p = POLICIES["bf16+fp16-head"]
    ns = run_snippet(export_policy(p, "lightning", policy_path=policy_file(p)).text)
    losses: list[float] = []

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = fp16_trouble.build_model()

        def configure_model(self):
            self.handle = ns["apply_precision_policy"](self.net)

        def training_step(self, batch, i):
            loss = torch.nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])
            losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    module = Module()
    seen = _dtypes_seen(module.net, ["hot", "head", "faint"])
    x, y = fp16_trouble.sample_batch()
    trainer = L.Trainer(**ns["trainer_kwargs"], accelerator="cpu", max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8))
    module.handle.remove()
    assert seen == {"hot": [torch.bfloat16] * 2, "head": [torch.float16] * 2, "faint": [torch.float32] * 2}
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)


def test_accelerate_snippet_runs_each_module_in_its_format(policy_file):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # an earlier test's Trainer leaves it set
    p = POLICIES["bf16+fp16-head"]
    ns = run_snippet(export_policy(p, "accelerate", policy_path=policy_file(p)).text)
    accelerator = Accelerator(**ns["accelerator_kwargs"], cpu=True)
    model = accelerator.prepare(fp16_trouble.build_model())
    handle = ns["apply_precision_policy"](model)
    try:
        seen = _dtypes_seen(accelerator.unwrap_model(model), ["hot", "head", "faint"])
        x, y = fp16_trouble.sample_batch()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        accelerator.backward(loss)
    finally:
        handle.remove()
        AcceleratorState._reset_state(reset_partial_state=True)
    assert seen == {"hot": [torch.bfloat16], "head": [torch.float16], "faint": [torch.float32]}
    assert math.isfinite(float(loss))


@pytest.mark.parametrize("target", ["lightning", "accelerate", "fsdp"])
def test_snippets_load_the_policy_from_anywhere(tmp_path, monkeypatch, target):
    """`export v100/policy.json` run in one folder wrote load_policy('v100/policy.json'): the training script, run
    from another folder, could not find it. The path is absolute now (a policy folder stands for its file)."""
    (tmp_path / "v100").mkdir()
    save_policy(POLICIES["fp16+hot"], tmp_path / "v100" / "policy.json")
    monkeypatch.chdir(tmp_path)
    for given in ("v100/policy.json", "v100"):
        assert export_main([given, "--to", target, "--out", f"out-{target}.py"]) == 0
        text = (tmp_path / f"out-{target}.py").read_text()
        assert f"load_policy({str(tmp_path / 'v100' / 'policy.json')!r})" in text
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir(exist_ok=True)
        monkeypatch.chdir(elsewhere)
        ns = run_snippet(text)
        assert ns["POLICY"].default_format == "fp16"
        monkeypatch.chdir(tmp_path)
