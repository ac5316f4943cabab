"""GEMMs outside ``nn.Linear`` (``torch.matmul``, ``@``, ``torch.bmm``, ``torch.mm`` inside a module's forward, e.g.
attention's Q K^T and P V) under the FP8 recipes (docs/fp8.md, "GEMMs outside nn.Linear").

Each call is measured where it happens, in one FP32 forward of the model: both operands quantised as the recipe
quantises a linear's forward operands (the first like the input, along its last dimension; the second like the
weight, along its reduction dimension, -2), the product computed in FP32 from the dequantised operands, and its
error against the FP32 product; with the saturated and flushed shares of each operand. Forward only: the backward
GEMMs of a functional matmul have no module whose gradient hooks give them their operands.

They are measured and reported, never planned: torchao 0.18's FP8 training converts ``nn.Linear`` modules only
(``convert_to_float8_training``), so no runtime path would apply a plan for them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..capture.stats import ErrorStats
from ..model_names import named_modules
from ..record.fp8 import Fp8OtherGemm, Fp8OtherGemmRecipe
from .linear import Fp8State, OperandStats, metrics_record
from .recipes import RECIPES

log = logging.getLogger(__name__)

#: why the plan leaves them alone (audit.json ``fp8.other_gemms[].plan``)
NOT_PLANNED = ("kept in the plan's format: torchao 0.18 converts only nn.Linear to FP8 (convert_to_float8_training); "
               "no runtime path applies a recipe to a functional matmul/bmm")
#: delayed scaling needs an amax history per tensor across steps, which a functional operand has no identity for
NOT_MEASURED = {"fp8_delayed": "not measured: delayed scaling keeps an amax history per tensor across steps, and an "
                               "operand of a functional matmul has no identity from step to step"}

_FUNCS: dict[Any, str] = {torch.matmul: "matmul", torch.Tensor.matmul: "matmul", torch.Tensor.__matmul__: "matmul",
                          torch.bmm: "bmm", torch.Tensor.bmm: "bmm", torch.mm: "mm", torch.Tensor.mm: "mm"}


@dataclass
class OtherGemm:
    module: str  # the innermost module whose forward made the call ("" for the root)
    op: str
    index: int  # the call's position among this module's GEMM calls of this op
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    flops: int = 0
    calls: int = 0
    recipes: dict[str, ErrorStats] = field(default_factory=dict)
    operands: dict[str, dict[str, OperandStats]] = field(default_factory=dict)  # recipe -> a / b


class _Catcher(TorchFunctionMode):
    def __init__(self, stack: list[str], recipes: tuple[str, ...]) -> None:
        super().__init__()
        self.stack, self.recipes = stack, recipes
        self.found: dict[tuple[str, str, int], OtherGemm] = {}
        self.seen: dict[tuple[str, str], int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = _FUNCS.get(func)
        if op is None or len(args) < 2 or kwargs:
            return out
        a, b = args[0], args[1]
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(out, torch.Tensor)
                and a.dim() >= 2 and b.dim() >= 2 and a.is_floating_point() and b.is_floating_point()):
            return out
        try:
            self._measure(op, a.detach(), b.detach(), out.detach())
        except Exception as e:  # a shape this emulation does not follow: reported in the log, the run goes on
            log.warning("FP8: could not measure a %s of shapes %s x %s: %s", op, tuple(a.shape), tuple(b.shape), e)
        return out

    def _measure(self, op: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        mod = self.stack[-1] if self.stack else ""
        k = self.seen.get((mod, op), 0)
        self.seen[(mod, op)] = k + 1
        g = self.found.setdefault((mod, op, k), OtherGemm(mod, op, k, tuple(a.shape), tuple(b.shape)))
        g.calls += 1
        g.flops += 2 * out.numel() * a.shape[-1]
        af, bf = a.float(), b.float()
        for rname in self.recipes:
            if rname in NOT_MEASURED:
                continue
            st = Fp8State(RECIPES[rname])
            qa = st.quant("output", "input", af, -1)
            qb = st.quant("output", "weight", bf, -2)
            y = torch.matmul(qa, qb)
            g.recipes.setdefault(rname, ErrorStats()).update(out.float(), y)
            ops = g.operands.setdefault(rname, {"a": OperandStats(), "b": OperandStats()})
            for role, key in (("a", ("output", "input")), ("b", ("output", "weight"))):
                s = st.stats.get(key)
                if s is not None:
                    _merge(ops[role], s)


def _merge(into: OperandStats, s: OperandStats) -> None:
    into.saturated += s.saturated
    into.flushed += s.flushed
    into.nonzero += s.nonzero
    into.nonfinite += s.nonfinite
    into.calls += s.calls
    into.scale_min = min(into.scale_min, s.scale_min)
    into.scale_max = max(into.scale_max, s.scale_max)


def measure_other_gemms(model: torch.nn.Module, run: Callable[[], Any], recipes: tuple[str, ...]) -> list[OtherGemm]:
    """Run ``run()`` (one forward of ``model``, without gradients) and measure every matmul/bmm/mm made outside an
    ``nn.Linear``; the caller seeds and puts the model back."""
    stack: list[str] = []
    hooks = []

    def enter(_m: torch.nn.Module, _args: Any, name: str) -> None:
        stack.append(name)

    def leave(_m: torch.nn.Module, _args: Any, _out: Any) -> None:  # returns None: the output is left as it is
        if stack:
            stack.pop()

    for name, m in named_modules(model):
        if isinstance(m, torch.nn.Linear):
            continue
        hooks.append(m.register_forward_pre_hook(lambda _m, _a, n=name: enter(_m, _a, n)))
        hooks.append(m.register_forward_hook(leave))
    catcher = _Catcher(stack, recipes)
    try:
        with torch.no_grad(), catcher:
            run()
    finally:
        for h in hooks:
            h.remove()
    return list(catcher.found.values())


def other_gemms_record(gemms: list[OtherGemm], budget_rel_error: float,
                       recipes: tuple[str, ...]) -> list[Fp8OtherGemm]:
    """audit.json's ``fp8.other_gemms`` (docs/fp8.md)."""
    out = []
    for g in gemms:
        per: dict[str, Fp8OtherGemmRecipe] = {}
        for rname, e in g.recipes.items():
            rel = e.metrics().get("rel_l2")
            per[rname] = Fp8OtherGemmRecipe(
                local={"output": metrics_record(e)},
                operands={f"output.{role}": s.to_record() for role, s in g.operands.get(rname, {}).items()},
                meets_budget=bool(isinstance(rel, float) and math.isfinite(rel) and rel <= budget_rel_error))
        for rname, why in NOT_MEASURED.items():
            if rname in recipes and rname not in per:
                per[rname] = Fp8OtherGemmRecipe(note=why)
        out.append(Fp8OtherGemm(module=g.module, op=g.op, index=g.index, a_shape=list(g.a_shape),
                                b_shape=list(g.b_shape), calls=g.calls, gemm_flops=g.flops, recipes=per,
                                plan=NOT_PLANNED))
    return out
