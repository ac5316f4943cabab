"""A/B check of a policy by short training: the same N steps from the same initial weights under FP32, under
the policy, and under plain BF16 and FP16 autocast (README.md, "Usage": ``precision-audit verify``). A policy
with an ``fp8`` key adds the arm ``policy_fp8``: the policy with its FP8 modules converted through torchao
(emulated unless the GPU has FP8 Tensor Cores; docs/fp8.md, "verify").

On a GPU the arms run under real ``torch.autocast("cuda")``; elsewhere CUDA autocast is emulated exactly as in
the audit. Every arm sees the same batch each step, the same seed and the same optimizer settings; plain FP16
uses ``torch.amp.GradScaler``'s defaults, the policy arm its controller (the policy's loss scaling).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import host_rng
from .errors import SEED_MAX, SEED_MIN, ModelRunError, OptionError, PolicyError
from .model_names import named_modules
from .policy.schema import RUNTIME_FORMATS, Policy
from .record import VerifyResult
from .tf32_switches import tf32_switches

log = logging.getLogger(__name__)

OPTIMIZERS = ("adam", "sgd")
#: The most training steps per arm ``verify --steps`` accepts (README.md).
MAX_STEPS = 1000


@dataclass(frozen=True)
class VerifyOptions:
    steps: int = 20
    lr: float = 1e-3
    optimizer: str = "adam"
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or not 1 <= self.steps <= MAX_STEPS:
            raise OptionError(f"--steps must be a whole number from 1 to {MAX_STEPS} for verify",
                              found=repr(self.steps), hint="a short run shows whether the policy trains; "
                              f"{MAX_STEPS} steps per arm is the most verify runs")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise OptionError("--lr must be a positive number", found=repr(self.lr))
        if self.optimizer not in OPTIMIZERS:
            raise OptionError(f"unknown --optimizer {self.optimizer!r}", choices=OPTIMIZERS)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX:
            raise OptionError("--seed is outside the range torch's random generators accept",
                              expected=f"a whole number from {SEED_MIN} to {SEED_MAX} (-2**63 to 2**64 - 1)",
                              found=repr(self.seed), hint="pick a smaller seed, e.g. --seed 0")


def _optimizer(opts: VerifyOptions, params) -> torch.optim.Optimizer:
    if opts.optimizer == "adam":
        return torch.optim.Adam(params, lr=opts.lr)
    return torch.optim.SGD(params, lr=opts.lr, momentum=0.9)


def run_verify(model: torch.nn.Module, forward: Callable[[torch.nn.Module], Any],
               loss_of: Callable[[Any], torch.Tensor], policy: Policy, device: str, mode: str,
               opts: VerifyOptions, progress: Callable[[str], None] | None = None) -> VerifyResult:
    """Train each arm ``opts.steps`` steps; returns the ``verify`` section of the audit's record (loss curves,
    final divergence, whether the policy arm failed; its ``loss`` is filled in by the caller)."""
    from .capture.reseeds import ReproducibleReseeds
    from .capture.user_autocast import UserAutocast
    from .emulation import CudaAutocastPolicy, emulated_autocast, resolve_kernels

    say = progress or (lambda m: None)
    device_type = "cuda" if mode == "cuda" else "cpu"

    def autocast(dtype: torch.dtype | None):
        if dtype is None:
            return contextlib.nullcontext()
        if mode == "cuda":
            return torch.autocast("cuda", dtype=dtype)
        return emulated_autocast(dtype)

    check_runtime_formats(policy)
    policy_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(policy.default_format)
    arms = [("fp32", None), ("policy", policy_dtype)]
    if check_fp8_arm(model, policy, mode, device):
        arms.append(("policy_fp8", policy_dtype))
    arms += [("bf16", torch.bfloat16), ("fp16", torch.float16)]
    curves: dict[str, list[float | None]] = {}
    final_params: dict[str, list[torch.Tensor]] = {}
    skipped: dict[str, int] = {}
    errors: dict[str, str] = {}
    draws = _StepDraws(mode == "cuda")
    with contextlib.ExitStack() as stack:
        # every GPU's generator is put back, not just the one the arms run on (a model may draw on another)
        stack.enter_context(host_rng.fork())
        stack.enter_context(ReproducibleReseeds())  # torch.seed() in a forward: every arm draws the same masks
        stack.enter_context(torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if mode == "cuda"
                                                  else []))
        if mode != "cuda":
            stack.enter_context(CudaAutocastPolicy(resolve_kernels("auto")))
            stack.enter_context(UserAutocast(emulated=True))  # the model's own CUDA autocast code (docs/emulation.md)
        for arm, dtype in arms:
            say(f"verify: {opts.steps} training steps under {arm}")
            torch.manual_seed(opts.seed)
            host_rng.seed(opts.seed)  # np.random / random in the forward: every arm draws the same
            m = copy.deepcopy(model).to(device)
            opt = _optimizer(opts, [p for p in m.parameters() if p.requires_grad])
            losses: list[float | None] = []
            try:
                # The FP32 arm is strict IEEE fp32 on CUDA, as the audit's reference: TF32 off for cuBLAS *and*
                # cuDNN; the user's exact settings come back after (precision_audit/tf32_switches.py).
                with (tf32_switches(matmul=False, cudnn=False) if arm == "fp32" and mode == "cuda"
                      else contextlib.nullcontext()), _armed(arm, policy, m, opt, device_type, mode,
                                                                     device) as step:
                    for i in range(opts.steps):
                        with autocast(dtype), draws.step(arm, i):
                            loss = loss_of(forward(m))
                        lv, skip = step(loss)
                        losses.append(lv if math.isfinite(lv) else None)
                        skipped[arm] = skipped.get(arm, 0) + int(skip)
            except torch.OutOfMemoryError:
                raise  # the GPU's limit, not the arm's: cli/main.py gives the advice
            except Exception as e:  # an arm that cannot train (e.g. a banned op under autocast) is reported
                errors[arm] = f"{type(e).__name__}: {e}"
                if arm == "fp32":  # nothing to compare with: not a finding about any format
                    raise _fp32_arm_failed(e, opts, m) from e
            curves[arm] = losses
            final_params[arm] = [p.detach().float().cpu() for p in m.parameters()]
    draws.warn()
    final_rel, param_rel = _divergence(curves, final_params)
    failure = policy_failure(errors, curves.get("policy") or [], final_params.get("policy") or [])
    if failure is None and "policy_fp8" in curves:
        failure = policy_failure(errors, curves["policy_fp8"], final_params.get("policy_fp8") or [], "policy_fp8")
    return VerifyResult(steps=opts.steps, optimizer=opts.optimizer, lr=opts.lr, seed=opts.seed, mode=mode,
                        curves=curves, skipped_steps=skipped, errors=errors, final_loss_rel_change=final_rel,
                        param_rel_change=param_rel, policy_failure=failure, policy_safe=failure is None)


class _StepDraws:
    """On CUDA, every arm's step k sees the FP32 arm's dropout masks of step k: seeding each arm alike is not
    enough there, the dropout kernel's draws depend on the dtype (capture/rng_replay.py; docs/gpu.md). The FP32
    arm records each step's draws (generator states and layouts, not the masks), the other arms replay them; so
    the arms' divergence is their arithmetic's, not their masks'. Elsewhere the CPU kernels draw the same masks
    from the same seed whatever the dtype, and nothing is recorded."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.steps: list[Any] = []  # RandomDraws of each FP32 step
        self.mismatches: dict[str, int] = {}

    @contextlib.contextmanager
    def step(self, arm: str, i: int) -> Iterator[None]:
        from .capture.rng_replay import RandomDraws, recording, replaying

        if not self.on:
            yield
            return
        if arm == "fp32":
            self.steps.append(RandomDraws())
            with recording(self.steps[-1]):
                yield
            return
        with replaying(self.steps[i] if i < len(self.steps) else RandomDraws()) as r:
            try:
                yield
            finally:
                self.mismatches[arm] = self.mismatches.get(arm, 0) + r.mismatches

    def warn(self) -> None:
        self.steps.clear()
        for arm, n in self.mismatches.items():
            if n:
                log.warning("verify: %d random draw(s) of the %s arm had no draw of the same shape at the same "
                            "position in the FP32 arm's step and were drawn anew: its dropout masks differ there",
                            n, arm)


def _divergence(curves: dict[str, list[float | None]], final_params: dict[str, list[torch.Tensor]]
                ) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """Each arm's final loss and final parameters against the FP32 arm's, relative (None where not finite)."""
    ref = curves.get("fp32") or []
    ref_final = ref[-1] if ref else None
    final_rel: dict[str, float | None] = {}
    param_rel: dict[str, float | None] = {}
    for arm in curves:
        if arm == "fp32":
            continue
        last = curves[arm][-1] if curves[arm] else None
        final_rel[arm] = abs(last - ref_final) / abs(ref_final) if last is not None and ref_final else None
        num = sum(float((a - b).double().pow(2).sum()) for a, b in zip(final_params[arm], final_params["fp32"]))
        den = sum(float(b.double().pow(2).sum()) for b in final_params["fp32"])
        param_rel[arm] = math.sqrt(num / den) if den and math.isfinite(num) else None
    return final_rel, param_rel


def _fp32_arm_failed(e: Exception, opts: VerifyOptions, model: torch.nn.Module) -> ModelRunError:
    """The FP32 arm is what every other arm is compared with: when it cannot train, verify says why (exit 2),
    before training the others and without writing anything."""
    sparse = [n for n, m in named_modules(model) if getattr(m, "sparse", False) is True]
    if opts.optimizer == "adam" and sparse:
        one = len(sparse) == 1
        hint = (f"{', '.join(sparse[:3])}{'' if len(sparse) <= 3 else ', ...'} {'has' if one else 'have'} "
                f"sparse=True: {'its gradient is' if one else 'their gradients are'} sparse, which torch.optim.Adam "
                "refuses; run verify with --optimizer sgd")
    else:
        hint = (f"make the model train in FP32 first (one step of loss.backward() and {opts.optimizer} at --lr "
                f"{opts.lr:g}); --optimizer {'sgd' if opts.optimizer == 'adam' else 'adam'} is the other choice")
    return ModelRunError(
        "verify's FP32 arm could not train, so there is no FP32 run to compare the policy with",
        expected=f"a model that trains {opts.steps} step(s) in FP32 with --optimizer {opts.optimizer}",
        found=f"{type(e).__name__}: {e}", hint=hint)


def policy_failure(errors: dict[str, str], curve: list[float | None], params: list[torch.Tensor],
                   arm: str = "policy") -> str | None:
    """Why the policy arm (or its FP8 arm, ``arm="policy_fp8"``) failed, or None when it trained: it raised, its
    loss went non-finite at the end, or its final parameters are not finite. ``precision-audit verify`` then exits
    1, "unsafe" (docs/report.md); the plain BF16 / FP16 arms failing is what a policy is for, and is only
    reported."""
    label = "policy" if arm == "policy" else f"policy's FP8 ({arm})"
    if arm in errors:
        return f"the {label} arm raised {errors[arm]}"
    if not curve or curve[-1] is None:
        bad = sum(v is None for v in curve)
        return f"the {label} arm's final loss is not finite ({bad} of {len(curve)} step(s) non-finite)"
    if any(not bool(torch.isfinite(p).all()) for p in params):
        return f"the {label} arm's parameters are not finite after training"
    return None


def _fp8_emulate(mode: str, device: str) -> bool:
    """torchao's ``emulate`` for the FP8 arm: on a GPU of compute capability 8.9 or later the real
    ``torch._scaled_mm`` kernels (as the runtime chooses, fp8/apply.py); elsewhere, and in emulated mode,
    emulated (FP32 GEMMs of the dequantised operands). Decided from the device the arms train on, so the check
    before training (which runs on a CPU copy) applies the same rules, e.g. dimensions that are multiples of 16."""
    if mode != "cuda":
        return True
    return torch.cuda.get_device_capability(torch.device(device)) < (8, 9)


def _fp8_under_emulated_autocast(model: torch.nn.Module, names: list[str]) -> None:
    """Under CUDA autocast, torchao's Float8Linear casts its input to the autocast dtype, quantises it and the
    FP32 weight to FP8 and returns the autocast dtype. The audit's CPU emulation of CUDA autocast rounds every
    GEMM operand through FP32, which torchao's FP8 tensors do not support; so in emulated mode every converted
    module runs autocast-safe (fp8/autocast_safe.py, as the runtime runs a recipe that keeps a GEMM in high
    precision): with autocast off on its input rounded to the autocast dtype, in FP32 from the dequantised FP8
    operands (torchao's ``emulate``), its output rounded to the autocast dtype, as on the GPU."""
    from .fp8.autocast_safe import make_autocast_safe

    make_autocast_safe(model, names)


def check_runtime_formats(policy: Policy) -> None:
    """Refuse, before any arm trains, a policy whose default or module formats the runtime cannot apply (autocast has
    no fp8; FP8 modules go in the policy's ``fp8`` section): its arm would fail after the FP32 arm had trained, and
    the policy be called unsafe (exit 1) for what is a policy the runtime does not take (exit 2)."""
    bad = {n or "(root)": o.format for n, o in policy.modules.items() if o.format not in RUNTIME_FORMATS}
    if policy.default_format not in RUNTIME_FORMATS:
        bad = {"(default)": policy.default_format, **bad}
    if bad:
        listing = ", ".join(f"{n}: {f}" for n, f in list(bad.items())[:12]) + (" ..." if len(bad) > 12 else "")
        raise PolicyError(f"verify cannot train this policy: the runtime cannot put these modules in their format "
                          f"(autocast has no fp8): {listing}", choices=RUNTIME_FORMATS,
                          hint="FP8 modules belong in the policy's fp8 section (docs/fp8.md); or change the policy")


def check_fp8_arm(model: torch.nn.Module, policy: Policy, mode: str, device: str = "cpu") -> bool:
    """Whether the policy has FP8 modules (then verify trains a ``policy_fp8`` arm). Checked before any training
    on a copy of the model: a plan the runtime cannot apply (torchao missing, a recipe it has no training path
    for, a module that is not an ``nn.Linear``) raises :class:`~precision_audit.errors.PolicyError` (exit 2)."""
    from .fp8.apply import apply_fp8
    from .fp8.policy import Fp8Plan

    plan = Fp8Plan.from_policy(policy)
    if not plan.modules:
        return False
    apply_fp8(copy.deepcopy(model), plan, emulate=_fp8_emulate(mode, device))
    return True


@contextlib.contextmanager
def _armed(arm: str, policy: Policy, model: torch.nn.Module, opt: torch.optim.Optimizer,
           device_type: str, mode: str = "emulated",
           device: str = "cpu") -> Iterator[Callable[[torch.Tensor], tuple[float, bool]]]:
    """A step function for one arm: (loss) -> (loss value, skipped)."""
    if arm in ("policy", "policy_fp8"):
        from .runtime.api import apply_policy
        from .runtime.api import controller as make_controller

        handle = apply_policy(model, policy, device_type=device_type)
        controller = make_controller(model, opt, policy, device=device_type)
        if arm == "policy_fp8":
            # the planned linears become torchao Float8Linear in place, keeping their parameters (the optimizer's);
            # after apply_policy and the controller: their fingerprint checks need the model the policy was made for
            from .fp8.apply import apply_fp8

            converted = apply_fp8(model, policy, emulate=_fp8_emulate(mode, device))
            if mode != "cuda":
                _fp8_under_emulated_autocast(model, converted)

        def step(loss):
            rec = controller.step(loss)
            return float(loss.detach().float()), bool(getattr(rec, "skipped", False))
        try:
            yield step
        finally:
            controller.close()
            handle.remove()
        return
    scaler = torch.amp.GradScaler(device_type, enabled=(arm == "fp16"))

    def plain(loss):
        before = scaler.get_scale() if scaler.is_enabled() else None
        scaler.scale(loss.float()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        skipped = before is not None and scaler.get_scale() < before
        return float(loss.detach().float()), skipped
    yield plain
