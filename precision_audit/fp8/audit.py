"""The audit's FP8 stage: asked for with ``--formats fp8_e4m3`` (or ``fp8``, ``fp8_e5m2``), it measures every
recipe on every ``nn.Linear``, prices it on the target, plans, and gives audit.json's ``fp8`` section and the
policy's ``fp8`` key (docs/fp8.md)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import host_rng
from ..gpus import GpuSpec
from ..record.fp8 import Fp8, Fp8Target
from .cost import ASSUMPTIONS, torchao_auto_filter
from .measure import measure_fp8, result_record
from .plan import Fp8PlanResult, make_verifier, plan_fp8
from .policy import Fp8Module, Fp8Plan
from .recipes import DEFAULT_RECIPES, RECIPES, supported

log = logging.getLogger(__name__)

#: the --formats names that ask for the FP8 stage
FP8_FORMAT_NAMES = ("fp8_e4m3", "fp8_e5m2")
SKIP_REASON = "measured per recipe in the fp8 section, not as an autocast pass (docs/fp8.md)"


def requested(formats: Iterable[Any] | None) -> bool:
    return any(str(getattr(f, "value", f)) in FP8_FORMAT_NAMES for f in (formats or ()))


def fp8_stage(model: torch.nn.Module, forward: Callable[[torch.nn.Module], Any],
              loss_of: Callable[[Any], torch.Tensor], target: GpuSpec, budget: Any, *, device: str = "cpu",
              seed: int = 0, say: Callable[[str], None] = lambda m: None,
              tokens_per_step: int | None = None) -> tuple[Fp8, Fp8Plan]:
    """Measure, price and plan; returns (audit.json's ``fp8`` section, the policy's FP8 plan).
    ``tokens_per_step`` (``--tokens-per-step``): the rows per training step each linear is priced at; None: the
    audited batch's."""
    # the stage reseeds the generators for every measurement (torch.manual_seed reseeds every CUDA device's too):
    # the user's are put back after, every device's (docs/memory.md, "What is kept")
    with torch.random.fork_rng(devices=_cuda_devices(device)), host_rng.fork():
        return _fp8_stage(model, forward, loss_of, target, budget, device=device, seed=seed, say=say,
                          tokens_per_step=tokens_per_step)


def _cuda_devices(device: str) -> list[int]:
    """The CUDA devices whose generators the stage's reseeding changes and must put back: all of them when it
    runs on CUDA or CUDA is in use in the process (as capture/session.py forks them), else none (forking them
    would start CUDA for nothing)."""
    cuda = device.startswith("cuda") or (torch.cuda.is_available() and torch.cuda.is_initialized())
    return list(range(torch.cuda.device_count())) if cuda else []


def _fp8_stage(model: torch.nn.Module, forward: Callable[[torch.nn.Module], Any],
               loss_of: Callable[[Any], torch.Tensor], target: GpuSpec, budget: Any, *, device: str,
               seed: int, say: Callable[[str], None], tokens_per_step: int | None) -> tuple[Fp8, Fp8Plan]:
    say(f"FP8: measuring {len(DEFAULT_RECIPES)} recipes on every linear layer (docs/fp8.md)")
    result = measure_fp8(model, forward, loss_of, DEFAULT_RECIPES, device=device, seed=seed)
    local_budget = budget.max_output_rel_error
    section = result_record(result, local_budget)
    if not result.layers:
        section.plan = None
        section.plan_note = "not planned: the model has no nn.Linear"
        return section, Fp8Plan()
    verify = make_verifier(model, forward, loss_of, result.reference_outputs, seed, device)
    plan: Fp8PlanResult = plan_fp8(result, target, max_local_rel_error=local_budget,
                                   max_loss_rel_change=budget.max_loss_rel_change,
                                   max_output_rel_error=budget.max_output_rel_error, verify=verify,
                                   tokens_per_step=tokens_per_step)
    section.plan = plan.to_record()
    cc = target.compute_capability
    section.target = Fp8Target(name=target.name, compute_capability=list(cc),
                               recipes_supported=[r for r in RECIPES if supported(RECIPES[r], cc)])
    section.cost_assumptions = list(ASSUMPTIONS)
    section.torchao_auto_filter = {
        L.name: {r: torchao_auto_filter(L.in_features, L.out_features, r) for r in ("fp8_tensorwise", "fp8_rowwise")}
        for L in result.layers}
    return section, Fp8Plan({n: Fp8Module(c.recipe, c.reason) for n, c in plan.choices.items() if c.recipe})
