"""Export a policy to the settings other training stacks read (docs/policy.md, "Exporting to other
stacks").

``precision-audit export policy.json --to deepspeed|lightning|accelerate|fsdp [--out FILE]``

Each target gets its nearest equivalent, and says what it cannot express:

- ``deepspeed``: a DeepSpeed config fragment (JSON): the ``fp16`` block (``initial_scale_power`` =
  log2(init_scale), ``loss_scale_window`` = growth_interval, ``hysteresis`` 2, ``min_loss_scale`` 1) or the
  ``bf16`` block; what it cannot express is listed under the top-level key ``precision_audit`` (DeepSpeed
  ignores unknown top-level keys; its ``fp16``/``bf16`` blocks reject unknown ones), with the per-module
  formats as data (``precision_audit.modules``: name -> format and reason).
- ``lightning``: Python to paste: the Trainer's ``precision`` (or a ``MixedPrecision`` plugin carrying the
  policy's GradScaler settings) plus ``apply_precision_policy(model)`` for the per-module part.
- ``accelerate``: Python: ``Accelerator(mixed_precision=..., kwargs_handlers=[GradScalerKwargs(...)])`` plus
  the per-module part.
- ``fsdp``: Python: ``MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)`` for FSDP1 and
  ``MixedPrecisionPolicy`` for FSDP2 (``fully_shard``), each module the policy keeps in another format its own unit
  gathered in that format's dtype, the per-module formats from precision_audit's runtime (``apply_policy`` and
  ``forward_autocast()``: parameter casting alone cannot keep an fp32 module's output fp32 for the ops after it), and
  a ``ShardedGradScaler`` for fp16.

Example::

    from precision_audit.export import export_policy   # every target, the FP8 ones included
    from precision_audit.policy import load_policy
    out = export_policy(load_policy("audit/policy.json"), "deepspeed")
    print(out.text); print(out.notes)

Text from the policy is untrusted (policy.json may be hand-edited or crafted; docs/policy.md, "Exporting to
other stacks"). Every string from it -- the model class, the target name, module names, reasons, and the
policy path -- reaches the output only as ``repr()`` (a Python string literal, in code or in a comment),
or through ``json.dumps`` in JSON; never raw. So a policy cannot add a line, a statement or an encoding
declaration to the generated file: its syntax tree is the same for any strings of the same shape
(tests/policy/test_hostile_export.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from .exported import Export
from .schema import Policy

_TORCH_DTYPE = {"fp32": "torch.float32", "tf32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}
_LIGHTNING = {"fp32": "32-true", "tf32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
_ACCELERATE = {"fp32": "no", "tf32": "no", "bf16": "bf16", "fp16": "fp16"}
_FP8 = ("fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class _Plan:
    whole: str  # the format of the whole model (the root's effective format)
    overrides: tuple[tuple[str, str, str], ...]  # (name, format, reason), root excluded, outermost first
    tf32: tuple[bool, bool]


def _plan(policy: Policy) -> _Plan:
    whole = policy.effective_format("")
    overrides = tuple(sorted(((n, o.format, o.reason) for n, o in policy.modules.items() if n),
                             key=lambda t: (t[0].count("."), t[0])))
    tf32 = (True, True) if whole == "tf32" else (policy.tf32_matmul, policy.tf32_cudnn)
    return _Plan(whole, overrides, tf32)


def _listing(overrides: tuple[tuple[str, str, str], ...], limit: int = 20) -> str:
    parts = [f"{n!r} -> {f}" + (f" ({r!r})" if r else "") for n, f, r in overrides[:limit]]
    more = f"; and {len(overrides) - limit} more" if len(overrides) > limit else ""
    return "; ".join(parts) + more


def _common_notes(policy: Policy, plan: _Plan) -> list[str]:
    notes = []
    if plan.whole in _FP8:
        notes.append(f"the default format {plan.whole} has no equivalent here; exported as bf16 (fp8 training "
                     "needs torchao.float8 or Transformer Engine)")
    fp8 = [n for n, f, _ in plan.overrides if f in _FP8]
    if fp8:
        notes.append(f"fp8 modules have no equivalent here and are left in the default format: "
                     f"{', '.join(map(repr, fp8))}")
    return notes


def _whole(plan: _Plan) -> str:
    return "bf16" if plan.whole in _FP8 else plan.whole


def _scale_power(init_scale: float) -> tuple[int, str | None]:
    power = math.log2(init_scale)
    p = round(power)
    if abs(power - p) > 1e-9:
        return p, (f"init_scale {init_scale:g} is not a power of two; initial_scale_power {p} starts at "
                   f"2^{p} = {2.0 ** p:g}")
    return p, None


# -- DeepSpeed ---------------------------------------------------------------------------------------------

def _deepspeed(policy: Policy, policy_path: str) -> Export:
    plan = _plan(policy)
    ls = policy.loss_scaling
    notes = _common_notes(policy, plan)
    whole = _whole(plan)
    cfg: dict = {}
    if whole == "fp16":
        power, warn = _scale_power(ls.init_scale)
        if warn:
            notes.append(warn)
        if ls.enabled:
            cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": power,
                           "loss_scale_window": ls.growth_interval, "hysteresis": 2, "min_loss_scale": 1}
            notes.append("hysteresis 2 (DeepSpeed's default) backs off only after 2 overflows in a row, where "
                         "torch.amp.GradScaler backs off at every overflow; set it to 1 to match the policy exactly")
            notes.append("min_loss_scale 1 is a floor GradScaler does not have")
            if ls.growth_factor != 2.0 or ls.backoff_factor != 0.5:
                notes.append(f"DeepSpeed grows and backs off the loss scale by a factor of 2; the policy asks for "
                             f"growth x{ls.growth_factor:g} and backoff x{ls.backoff_factor:g}")
        else:
            cfg["fp16"] = {"enabled": True, "loss_scale": 1.0}
            notes.append("the policy disables loss scaling: exported as a static loss scale of 1")
        notes.append("DeepSpeed's fp16 mode casts the model's weights to fp16 and runs every op in fp16; "
                     "torch.autocast (what the policy was measured with) keeps softmax, norms and losses in fp32")
    elif whole == "bf16":
        cfg["bf16"] = {"enabled": True}
        notes.append("DeepSpeed's bf16 mode casts the model's weights to bf16 and runs every op in bf16; "
                     "torch.autocast (what the policy was measured with) keeps softmax, norms and losses in fp32")
        if ls.enabled:
            notes.append("the policy enables loss scaling (for its fp16 modules); DeepSpeed's bf16 mode has none")
    else:
        cfg["fp16"] = {"enabled": False}
        cfg["bf16"] = {"enabled": False}
    if plan.overrides:
        notes.append("DeepSpeed's fp16/bf16 blocks have no per-module formats; these modules cannot be kept in "
                     f"their policy format: {_listing(plan.overrides)}. To keep them, use DeepSpeed's "
                     "\"torch_autocast\" section instead (fp32 weights, forward under torch.autocast) and apply "
                     "the policy to engine.module with precision_audit's runtime "
                     "(precision_audit.apply_policy(engine.module, policy))")
    if any(plan.tf32):
        notes.append(f"TF32 is not a DeepSpeed setting: in the training script set "
                     f"torch.backends.cuda.matmul.allow_tf32 = {plan.tf32[0]} and "
                     f"torch.backends.cudnn.allow_tf32 = {plan.tf32[1]}")
    cfg["precision_audit"] = {
        "exported_from": policy_path,
        "model": policy.model_class,
        "target": policy.target_name,
        "modules": {n: {"format": f, "reason": r} for n, f, r in plan.overrides},
        "merge": "merge the fp16/bf16 blocks above into your DeepSpeed config",
        "cannot_express": notes,
    }
    return Export("deepspeed", json.dumps(cfg, indent=2) + "\n", ".json", tuple(notes))


# -- Python snippets ---------------------------------------------------------------------------------------

def _comment(text: str) -> str:
    """``text`` made safe for a ``#`` comment: every character that is not printable (line breaks of any
    kind, control and format characters, surrogates) is written as its escape, so the comment stays one line.
    The notes are built from fixed text and ``repr()`` of the policy's strings, for which this changes nothing."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _header(policy: Policy, plan: _Plan, target: str, policy_path: str, notes: list[str]) -> list[str]:
    # The first two lines hold no text from the policy: Python reads an encoding declaration there (PEP 263).
    lines = [f"# {target} settings exported by precision-audit (precision-audit export --to {target.lower()}).",
             "# Strings from the policy are shown as Python literals.",
             _comment(f"# Model class {policy.model_class!r}, policy {policy_path!r}, target GPU "
                      f"{policy.target_name!r}; whole model {plan.whole}; {len(plan.overrides)} per-module "
                      "override(s)."), "#"]
    if notes:
        lines.append(f"# What {target} cannot express by itself:")
        for n in notes:
            lines.append(_comment(f"#  - {n}"))
    else:
        lines.append(f"# {target} expresses this policy fully.")
    return lines


def _tf32_lines(plan: _Plan, who: str) -> list[str]:
    return [f"# TF32 for fp32 matmuls and cuDNN convolutions, as the policy says ({who} does not set these):",
            f"torch.backends.cuda.matmul.allow_tf32 = {plan.tf32[0]}",
            f"torch.backends.cudnn.allow_tf32 = {plan.tf32[1]}"]


def _scaler_args(policy: Policy) -> str:
    ls = policy.loss_scaling
    return (f"init_scale={ls.init_scale!r}, growth_factor={ls.growth_factor!r}, backoff_factor={ls.backoff_factor!r}, "
            f"growth_interval={ls.growth_interval!r}, enabled={ls.enabled!r}")


def _apply_function(plan: _Plan, when: str) -> list[str]:
    # The overrides are listed in comments (repr of each name and reason), never in the docstring: a
    # string literal inside a docstring could close it.
    listed = [_comment(f"#   {n!r} -> {f}" + (f" ({r!r})" if r else "")) for n, f, r in plan.overrides[:8]]
    if len(plan.overrides) > 8:
        listed.append(f"#   and {len(plan.overrides) - 8} more")
    return ["", "",
            "# The modules the policy overrides:" if plan.overrides else "# The policy overrides no module.",
            *listed,
            "def apply_precision_policy(model: torch.nn.Module):",
            '    """The per-module part of the policy, for the network the policy was made for.',
            "",
            f"    When: {when}.",
            "    Puts each module the policy overrides (listed above) in its format inside the whole-model",
            "    autocast (and checks the model's fingerprint). Keep the returned handle; handle.remove() undoes it.",
            '    """',
            "    return apply_policy(model, POLICY)"]


def _runtime_notes(plan: _Plan, target: str) -> list[str]:
    if not plan.overrides:
        return []
    return [f"{target}'s precision setting applies one format to the whole model; apply_precision_policy() "
            f"below keeps these modules in their own format with precision_audit's runtime: "
            f"{_listing(plan.overrides)}"]


def _lightning(policy: Policy, policy_path: str) -> Export:
    plan = _plan(policy)
    whole = _whole(plan)
    ls = policy.loss_scaling
    notes = _common_notes(policy, plan) + _runtime_notes(plan, "Lightning")
    if whole == "bf16" and ls.enabled:
        notes.append("the policy enables loss scaling (for its fp16 modules); Lightning's bf16-mixed has no GradScaler")
    if whole == "tf32":
        notes.append("Lightning has no TF32 precision: 32-true with the TF32 switches set below")
    code = ["import torch", "import lightning as L", "from lightning.pytorch.plugins import MixedPrecision",
            "from precision_audit import apply_policy, load_policy", "", f"POLICY = load_policy({policy_path!r})", ""]
    code += _tf32_lines(plan, "Lightning") + [""]
    if whole == "fp16":
        code += ["# The whole step's precision (the policy's default format) with the policy's loss scaling:",
                 "precision_plugin = MixedPrecision(",
                 '    "16-mixed", "cuda",',
                 f'    scaler=torch.amp.GradScaler("cuda", {_scaler_args(policy)}),',
                 ")",
                 'trainer_kwargs = {"plugins": [precision_plugin]}']
    else:
        code += ["# The whole step's precision (the policy's default format):",
                 f'trainer_kwargs = {{"precision": {_LIGHTNING[whole]!r}}}']
    code += ["# trainer = L.Trainer(**trainer_kwargs, ...your other arguments...)"]
    code += _apply_function(plan, "call it in your LightningModule's configure_model() (or __init__)")
    text = "\n".join(_header(policy, plan, "Lightning", policy_path, notes) + [""] + code) + "\n"
    return Export("lightning", text, ".py", tuple(notes))


def _accelerate(policy: Policy, policy_path: str) -> Export:
    plan = _plan(policy)
    whole = _whole(plan)
    ls = policy.loss_scaling
    notes = _common_notes(policy, plan) + _runtime_notes(plan, "Accelerate")
    if whole == "bf16" and ls.enabled:
        notes.append("the policy enables loss scaling (for its fp16 modules); Accelerate's bf16 has no GradScaler")
    if whole == "tf32":
        notes.append("Accelerate has no TF32 mixed_precision: \"no\" with the TF32 switches set below")
    code = ["import torch", "from accelerate import Accelerator", "from accelerate.utils import GradScalerKwargs",
            "from precision_audit import apply_policy, load_policy", "", f"POLICY = load_policy({policy_path!r})", ""]
    code += _tf32_lines(plan, "Accelerate") + [""]
    code += ["# The whole model's precision (the policy's default format)"
             + (" with the policy's loss scaling:" if whole == "fp16" else ":"),
             "accelerator_kwargs = {",
             f'    "mixed_precision": {_ACCELERATE[whole]!r},']
    if whole == "fp16":
        code += [f'    "kwargs_handlers": [GradScalerKwargs({_scaler_args(policy)})],']
    code += ["}", "# accelerator = Accelerator(**accelerator_kwargs)"]
    code += _apply_function(plan, "call it after accelerator.prepare(model, ...) (the DDP / compile wrappers "
                                  "are looked through)")
    text = "\n".join(_header(policy, plan, "Accelerate", policy_path, notes) + [""] + code) + "\n"
    return Export("accelerate", text, ".py", tuple(notes))


# The FSDP helpers the generated file defines: fixed code (nothing from the policy) that reads MODULE_FORMATS.
# Each module in another format is its own unit whose parameters are gathered in its format's dtype; no unit casts
# its inputs or its output (an fp32 module's output stays fp32, as under autocast): the per-module formats are
# precision_audit's runtime's (apply_policy + autocast), which casts at each op as autocast does. Casting the output
# back to the parent's dtype instead (output_dtype) turned a module kept in fp32 for its overflow back into fp16
# infinities: the loss was NaN (issue 32).
_FSDP_HELPERS = (
    "def wrap_fsdp1(model: torch.nn.Module, **fsdp_kwargs) -> FSDP:",
    '    """FSDP1: apply the policy\'s per-module formats, wrap each MODULE_FORMATS module (innermost first) in its',
    '    own unit gathered in its dtype, then the model with `mixed_precision`. Run the forward under',
    '    forward_autocast()."""',
    "    HANDLES.append(apply_policy(model, POLICY))",
    "    for name in sorted(MODULE_FORMATS, key=lambda n: -n.count(\".\")):",
    "        parent_name, _, child = name.rpartition(\".\")",
    "        parent = model.get_submodule(parent_name)",
    "        unit = MixedPrecision(param_dtype=MODULE_FORMATS[name], reduce_dtype=torch.float32,",
    "                              buffer_dtype=torch.float32)",
    "        setattr(parent, child, FSDP(getattr(parent, child), mixed_precision=unit, **fsdp_kwargs))",
    "    return FSDP(model, mixed_precision=mixed_precision, **fsdp_kwargs)",
    "",
    "",
    "def shard_fsdp2(model: torch.nn.Module, **fully_shard_kwargs) -> torch.nn.Module:",
    '    """FSDP2: fully_shard each MODULE_FORMATS module (innermost first) as its own unit gathered in its',
    '    dtype, then the model with `mp_policy`, and apply the policy\'s per-module formats. Run the forward',
    '    under forward_autocast()."""',
    "    for name in sorted(MODULE_FORMATS, key=lambda n: -n.count(\".\")):",
    "        unit = MixedPrecisionPolicy(param_dtype=MODULE_FORMATS[name], reduce_dtype=torch.float32,",
    "                                    cast_forward_inputs=False)",
    "        fully_shard(model.get_submodule(name), mp_policy=unit, **fully_shard_kwargs)",
    "    fully_shard(model, mp_policy=mp_policy, **fully_shard_kwargs)",
    "    HANDLES.append(apply_policy(model, POLICY))",
    "    return model",
    "",
    "",
    "def forward_autocast(device_type: str = \"cuda\"):",
    '    """The forward pass\'s context: autocast in the policy\'s default format (precision_audit.autocast); the',
    '    modules the policy overrides run in their own format inside it."""',
    "    return autocast(POLICY, device_type)",
)


def _fsdp_notes(policy: Policy, plan: _Plan) -> list[str]:
    notes = _common_notes(policy, plan)
    notes.append("each unit gathers its parameters in its format's dtype (param_dtype) and the forward runs under "
                 "precision_audit's autocast with the policy applied, as the policy was measured, except that ops "
                 "autocast keeps in fp32 (norms, embeddings) read parameters rounded to their unit's dtype; for "
                 "fp32 parameters everywhere use precision_audit.shard_fsdp2(model, policy) instead")
    tf32_mods = [n for n, f, _ in plan.overrides if f == "tf32"]
    if tf32_mods:
        notes.append(f"TF32 is a global switch, not an FSDP setting: the tf32 modules get it from precision_audit's "
                     f"runtime: {', '.join(map(repr, tf32_mods))}")
    if _whole(plan) == "bf16" and policy.loss_scaling.enabled:
        notes.append("the policy enables loss scaling (for its fp16 modules): use the ShardedGradScaler below")
    return notes


def _fsdp(policy: Policy, policy_path: str) -> Export:
    plan = _plan(policy)
    whole = _whole(plan)
    notes = _fsdp_notes(policy, plan)
    module_formats = [(n, f) for n, f, _ in plan.overrides if f not in _FP8]
    whole_dtype = _TORCH_DTYPE[whole]
    code = ["import torch",
            "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP",
            "from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, fully_shard",
            "from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler", "",
            "from precision_audit import apply_policy, autocast, load_policy", "",
            f"POLICY = load_policy({policy_path!r})",
            "HANDLES = []  # apply_policy's handles (handle.remove() puts the modules' forwards back)", ""]
    code += _tf32_lines(plan, "FSDP") + [""]
    code += ["# The whole model: parameters gathered in the policy's default format; gradients reduced and buffers",
             "# kept in fp32 (as under autocast, whose gradients and buffers are fp32)."]
    if whole in ("bf16", "fp16"):
        code += [f"mixed_precision = MixedPrecision(param_dtype={whole_dtype}, reduce_dtype=torch.float32, "
                 "buffer_dtype=torch.float32,",
                 "                                 cast_root_forward_inputs=False)",
                 f"mp_policy = MixedPrecisionPolicy(param_dtype={whole_dtype}, reduce_dtype=torch.float32, "
                 "cast_forward_inputs=False)"]
    else:
        code += ["mixed_precision = None  # the policy trains in fp32",
                 "mp_policy = MixedPrecisionPolicy(cast_forward_inputs=False)"]
    code += ["", "# The per-module part: modules the policy keeps in another format become their own FSDP units,",
             "# their parameters gathered in that format's dtype. name: dtype",
             "MODULE_FORMATS = {"]
    for n, f in module_formats:
        code.append(f"    {n!r}: {_TORCH_DTYPE[f]},  # {f}")
    code += ["}", "", "", *_FSDP_HELPERS, "", ""]
    uses_fp16 = whole == "fp16" or any(f == "fp16" for _, f in module_formats)
    if uses_fp16 or policy.loss_scaling.enabled:
        code += ["# Loss scaling for fp16, as the policy says, for FSDP1 and FSDP2 alike: each rank holds a shard of",
                 "# the gradients, and ShardedGradScaler all-reduces the found-inf flag so that every rank skips the",
                 "# same steps.",
                 'scaler = ShardedGradScaler("cuda" if torch.cuda.is_available() else "cpu",',
                 f'                           {_scaler_args(policy)})']
    else:
        code += ["scaler = None  # no fp16 in this policy: no loss scaling"]
    text = "\n".join(_header(policy, plan, "FSDP", policy_path, notes) + [""] + code) + "\n"
    return Export("fsdp", text, ".py", tuple(notes))


#: The mixed-precision targets, in the order ``precision-audit export --help`` lists them; the FP8 targets are
#: fp8/export.py's, and precision_audit/export.py's ``export_policy`` dispatches to both.
EXPORTERS: dict[str, Callable[[Policy, str], Export]] = {
    "deepspeed": _deepspeed, "lightning": _lightning, "accelerate": _accelerate, "fsdp": _fsdp,
}
