"""Does a TF32 policy's backward run under TF32? (issue 31 item 3; the acceptance run, bench/gpu_checks.sh)

    python bench/tf32_backward_check.py [--device cuda|cpu]

A small model (a linear layer and a convolution, the two kinds of TF32 switch: cuBLAS matmuls and cuDNN
convolutions) runs one training step under a policy whose default format is ``tf32``, with the convolution
overridden to ``fp32`` (strict: TF32 off). Hooks read torch's two TF32 switches (precision_audit/tf32_switches.py
``tf32_enabled``: matmul, cuDNN convolution) inside each module's forward and inside its backward (a hook on the
gradient of its output runs just before its backward kernels). Audited TF32 runs its backward under TF32 too
(capture/session.py), so the policy must: the tf32 module reads (True, True) forward and backward, the fp32 one
(False, False). Prints one JSON line and exits 0 when every reading is as expected, 1 otherwise. The switches are
flags, so the check runs on a CPU too (it then says so); on a GPU the same flags pick the kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import precision_audit as pa  # noqa: E402
from precision_audit.policy import LossScaling, ModuleOverride, Policy, fingerprint, model_layout  # noqa: E402
from precision_audit.tf32_switches import tf32_enabled  # noqa: E402


class Net(nn.Module):
    """The policy's modules wrap the layers the hooks read in (a module's own pre-hooks run outside its forward,
    where the policy switches TF32)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(16, 16))
        self.conv = nn.Sequential(nn.Conv1d(16, 16, 3, padding=1))

    def forward(self, x):
        return self.conv(self.fc(x).transpose(1, 2)).mean()


def check(device: str) -> dict:
    torch.manual_seed(0)
    model = Net().to(device)
    fp, n = fingerprint(model)
    policy = Policy(model_class="Net", model_fingerprint=fp, model_modules=n, target_name="check",
                    target_compute_capability=None, default_format="tf32",
                    modules={"conv": ModuleOverride("fp32", "strict FP32: TF32 off, forward and backward")},
                    loss_scaling=LossScaling(), tf32_matmul=True, tf32_cudnn=True, model_layout=model_layout(model))
    seen: dict[str, list] = {"fc.forward": [], "fc.backward": [], "conv.forward": [], "conv.backward": []}
    def watch(name: str, layer: nn.Module) -> None:
        def on_output(mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
            # the gradient of a layer's output arrives just before its backward kernels run
            out.register_hook(lambda g: seen[f"{name}.backward"].append(tf32_enabled()))

        layer.register_forward_pre_hook(lambda mod, args: seen[f"{name}.forward"].append(tf32_enabled()))
        layer.register_forward_hook(on_output)

    watch("fc", model.fc[0])
    watch("conv", model.conv[0])
    x = torch.randn(4, 8, 16, device=device)
    handle = pa.apply_policy(model, policy, device_type="cuda")  # TF32 switches are CUDA's (flags on a CPU)
    try:
        with pa.autocast(policy, device.split(":")[0]):
            loss = model(x)
        loss.backward()
    finally:
        handle.remove()
    want = {"fc.forward": (True, True), "fc.backward": (True, True),
            "conv.forward": (False, False), "conv.backward": (False, False)}
    readings = {k: sorted(set(v)) for k, v in seen.items()}
    ok = all(readings[k] == [want[k]] for k in want)
    return {"device": device, "readings": {k: [list(r) for r in v] for k, v in readings.items()},
            "expected": {k: list(v) for k, v in want.items()}, "pass": ok,
            "note": None if device.startswith("cuda") else "no GPU: the switches are flags, read on the CPU"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    result = check(p.parse_args().device)
    print(json.dumps(result))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
