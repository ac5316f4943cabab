"""Apply a plan's FP8 modules through torchao (docs/fp8.md, "Runtime").

``convert_to_float8_training`` is called once per recipe the plan uses, each time with a ``module_filter_fn``
that accepts exactly the modules planned for that recipe, so each module gets its own recipe's
``Float8LinearConfig``; a config that keeps a GEMM in high precision makes its modules autocast-safe
(fp8/autocast_safe.py). Recipes torchao 0.18 has no dense-linear training path for (Transformer Engine's
delayed scaling, MXFP8 and NVFP4 linears) are refused with a message saying so, before anything is changed.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ..errors import PolicyError
from ..model_names import named_modules
from .policy import Fp8Plan
from .recipes import RECIPES

log = logging.getLogger(__name__)

#: torchao 0.18 has no training path for these (delayed scaling was removed from torchao.float8; its MX and
#: NVFP4 support covers inference and MoE grouped GEMMs, not nn.Linear training)
_NO_TORCHAO_TRAINING = {
    "fp8_delayed": "torchao 0.18 has no delayed scaling (it is Transformer Engine's recipe): use fp8_tensorwise, "
                   "or Transformer Engine's DelayedScaling",
    "mxfp8": "torchao 0.18 trains MXFP8 only in MoE grouped GEMMs, not nn.Linear; use Transformer Engine's "
             "MXFP8BlockScaling on a CC 10.x GPU",
    "nvfp4": "torchao 0.18 has NVFP4 for inference only, no training path",
}


def _torchao():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as e:  # ImportError, or torchao failing to load against this torch
        raise PolicyError("the policy puts modules in FP8, which the runtime applies through torchao, and torchao "
                          "cannot be imported", found=f"{type(e).__name__}: {e}",
                          hint="pip install 'precision-audit[fp8]' (torchao==0.18.0)") from None
    return Float8LinearConfig, convert_to_float8_training


def _default_emulate(model: torch.nn.Module) -> bool:
    """Real FP8 GEMMs need a CUDA GPU of compute capability 8.9 or later (torch._scaled_mm); elsewhere torchao
    runs them emulated (FP32 from the dequantised operands)."""
    p = next(iter(model.parameters()), None)
    if p is None or p.device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(p.device) < (8, 9)


def apply_fp8(model: torch.nn.Module, plan: Fp8Plan | dict[str, str] | Any, *,
              emulate: bool | None = None) -> list[str]:
    """Convert the planned ``nn.Linear`` modules of ``model`` in place to torchao ``Float8Linear``; returns the
    converted module names. ``plan``: an :class:`Fp8Plan`, a loaded policy, or ``{module name: recipe}``.
    ``emulate=None`` emulates unless the model is on a CUDA GPU with FP8 Tensor Cores."""
    if isinstance(plan, dict):
        plan = Fp8Plan.from_dict({"modules": {n: {"recipe": r} for n, r in plan.items()}})
    elif not isinstance(plan, Fp8Plan):
        plan = Fp8Plan.from_policy(plan)
    if not plan.modules:
        return []
    mods = dict(named_modules(model))
    problems = []
    for name, m in sorted(plan.modules.items()):
        if m.recipe in _NO_TORCHAO_TRAINING:
            problems.append(f"{name!r} ({m.recipe}): {_NO_TORCHAO_TRAINING[m.recipe]}")
        elif name not in mods:
            problems.append(f"{name!r}: no such module in the model")
        elif type(mods[name]) is not torch.nn.Linear:
            problems.append(f"{name!r}: is {type(mods[name]).__name__}, torchao converts only nn.Linear")
    if emulate is None:
        emulate = _default_emulate(model)
    if not emulate:
        for name in sorted(plan.modules):
            lin = mods.get(name)
            if isinstance(lin, torch.nn.Linear) and (lin.in_features % 16 or lin.out_features % 16):
                problems.append(f"{name!r}: in/out features {lin.in_features}x{lin.out_features} are not multiples "
                                "of 16, which torch._scaled_mm needs")
    if problems:
        raise PolicyError("the runtime cannot put these modules in FP8: " + "; ".join(problems),
                          choices=[r for r in RECIPES if r not in _NO_TORCHAO_TRAINING],
                          hint="change the policy's fp8.modules (docs/fp8.md)")
    Float8LinearConfig, convert = _torchao()
    by_recipe: dict[str, set[str]] = {}
    for name, m in plan.modules.items():
        by_recipe.setdefault(m.recipe, set()).add(name)
    converted: list[str] = []
    for recipe, names in sorted(by_recipe.items()):
        cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(RECIPES[recipe].torchao_recipe), emulate=emulate)

        def only(mod: torch.nn.Module, fqn: str, _names=frozenset(names)) -> bool:
            return fqn in _names

        convert(model, module_filter_fn=only, config=cfg)
        converted += sorted(names)
        log.info("converted %d module(s) to FP8 (%s, emulate=%s)", len(names), recipe, emulate)
        _autocast_safe_if_needed(model, names, cfg, recipe)
    return sorted(converted)


def _autocast_safe_if_needed(model: torch.nn.Module, names: set[str], cfg, recipe: str) -> None:
    """A config that keeps a GEMM in high precision (a cast config ``ScalingType.DISABLED``) fails under autocast in
    torchao 0.18: its modules become autocast-safe (fp8/autocast_safe.py; docs/fp8.md, "Runtime")."""
    from .autocast_safe import keeps_a_gemm_in_high_precision, make_autocast_safe

    if keeps_a_gemm_in_high_precision(cfg):
        make_autocast_safe(model, names)
        log.info("%s keeps a GEMM in high precision: its %d module(s) run autocast-safe", recipe, len(names))
