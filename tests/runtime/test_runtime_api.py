"""Issue 13 item 5: the policy record is data, the runtime is the runtime's.

- ``precision_audit.apply_policy / autocast / grad_scaler / controller`` are the runtime's functions and do what
  the old ``Policy`` methods did (the behaviour itself is tested in tests/runtime/test_runtime.py);
- the record has no runtime methods, and a caller of the old spelling is told the new one;
- the policy package imports nothing from the runtime, at module level or inside a function (a static scan of
  its source, so a lazy import counts too), and importing it loads no runtime module.
"""

from __future__ import annotations

import ast
import copy
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import precision_audit as pa
from models import tiny_mlp
from precision_audit.policy import LossScaling, ModuleOverride, Policy, fingerprint, model_layout
from precision_audit.runtime import PolicyAutocast, PolicyHandle, PrecisionController, active_handle

PACKAGE = Path(pa.__file__).resolve().parent


def _policy(model: nn.Module, default: str = "bf16", overrides: dict[str, str] | None = None,
            loss_scaling: LossScaling | None = None) -> Policy:
    fp, n = fingerprint(model)
    return Policy(model_class=type(model).__name__, model_fingerprint=fp, model_modules=n, target_name="test",
                  target_compute_capability=None, default_format=default,
                  modules={k: ModuleOverride(v, "test") for k, v in (overrides or {}).items()},
                  loss_scaling=loss_scaling or LossScaling(), model_layout=model_layout(model))


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return tiny_mlp(8, 8, 4)


def test_the_four_functions_run_a_training_step():
    model = _net()
    policy = _policy(model, "bf16", {"2": "fp32"}, LossScaling(enabled=True, init_scale=2.0 ** 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = pa.apply_policy(model, policy)
    assert isinstance(handle, PolicyHandle) and active_handle(model) is handle
    assert handle.modules == {"2": "fp32"}
    ctl = pa.controller(model, opt, policy, device="cpu")
    assert isinstance(ctl, PrecisionController) and ctl.policy is policy
    ctx = pa.autocast(policy, "cpu")
    assert isinstance(ctx, PolicyAutocast)
    seen = {}
    model[0].register_forward_hook(lambda m, i, o: seen.__setitem__("0", o.dtype))
    model[2].register_forward_hook(lambda m, i, o: seen.__setitem__("2", o.dtype))
    with ctx:
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    assert seen == {"0": torch.bfloat16, "2": torch.float32}  # the default inside autocast, the override in fp32
    rec = ctl.step(loss)
    assert not rec.skipped and ctl.steps == 1
    ctl.close()
    handle.remove()
    assert active_handle(model) is None


def test_grad_scaler_carries_the_policys_loss_scaling():
    ls = LossScaling(enabled=True, init_scale=2.0 ** 12, growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    s = pa.grad_scaler(_policy(_net(), "fp16", loss_scaling=ls), "cpu")
    assert (s.get_scale(), s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == \
        (2.0 ** 12, 3.0, 0.25, 7)
    assert not pa.grad_scaler(_policy(_net(), "bf16"), "cpu").is_enabled()


def test_apply_policy_refuses_the_arguments_swapped():
    model = _net()
    with pytest.raises(TypeError, match=r"apply_policy\(model, policy\)"):
        pa.apply_policy(_policy(model), model)
    assert active_handle(model) is None


@pytest.mark.parametrize("method", ["apply", "autocast", "grad_scaler", "controller"])
def test_the_record_has_no_runtime_methods(method):
    policy = _policy(_net())
    assert not hasattr(policy, method)
    with pytest.raises(AttributeError, match=r"precision_audit\.\w+\(") as e:
        getattr(policy, method)
    assert f"Policy.{method}()" in str(e.value)
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        policy.nonsense  # noqa: B018 - any other missing name is an ordinary AttributeError
    # The hook on missing names leaves copying and pickling alone (they probe for optional methods).
    assert copy.deepcopy(policy) == policy == pickle.loads(pickle.dumps(policy))


def test_the_top_level_names_are_the_runtimes():
    from precision_audit.runtime import api

    assert (pa.apply_policy, pa.autocast, pa.grad_scaler, pa.controller) == \
        (api.apply_policy, api.autocast, api.grad_scaler, api.controller)
    assert {"apply_policy", "autocast", "grad_scaler", "controller"} <= set(pa.__all__)


def _imported_modules(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports, anywhere in it (function-level imports too), as absolute names."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
    return out


def test_the_policy_package_never_imports_the_runtime():
    offenders = {}
    for path in sorted((PACKAGE / "policy").glob("*.py")):
        # Relative imports in policy/*.py resolve against the package precision_audit.policy.
        bad = sorted(m for m in _imported_modules(path, "precision_audit.policy")
                     if m.startswith("precision_audit.runtime"))
        if bad:
            offenders[path.name] = bad
    assert not offenders, f"policy/ imports the runtime (the record must stay data only): {offenders}"


def test_importing_the_policy_loads_no_runtime_module():
    code = ("import sys, precision_audit.policy as p; p.load_policy; "
            "print(sorted(m for m in sys.modules if m.startswith('precision_audit.runtime')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
