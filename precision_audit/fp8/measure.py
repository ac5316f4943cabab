"""Per-layer measurement of the FP8 / block-scaled recipes (docs/fp8.md, "What is measured").

For every ``nn.Linear`` of the model and every recipe:

- *local* error: the module alone, on its exact FP32 inputs (each call), forward output and, from the FP32
  reference's dL/dy, its grad_input and grad_weight; against the same GEMMs in FP32. Metrics are
  capture/stats.py's :class:`ErrorStats` (rel_l2, SQNR, max |error|, cosine), plus a per-token relative error
  (each output row against its own reference norm), which outlier tokens cannot hide;
- *accumulated* error: the whole model with every linear under the recipe, each module's output and weight
  gradient against the FP32 reference, and the loss;
- what each quantisation did: shares of saturated and flushed values, the scales chosen, per GEMM operand
  (forward activations and weights, backward gradients);
- delayed scaling: the steps at which the amax history would have been stale (the step's amax saturating under
  the scale taken from earlier steps), over ``history_steps`` steps of the audited batch.

The model is run in place and put back exactly (capture/__init__.py's :class:`ModelState`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import host_rng
from ..capture import ModelState
from ..capture.records import float_tensors
from ..capture.stats import CHUNK, ErrorStats
from ..model_names import named_modules
from ..record.fp8 import Fp8, Fp8Budget, Fp8Layer, Fp8LayerRecipe, Fp8Metrics, Fp8RecipeInfo
from .linear import Fp8State, OperandStats, fp8_linear, metrics_record, patched
from .other_gemms import OtherGemm, measure_other_gemms, other_gemms_record
from .recipes import DEFAULT_RECIPES, RECIPES, Recipe

log = logging.getLogger(__name__)


@dataclass
class TokenError:
    """Per-token relative error: sqrt(mean over rows of |y_p,r - y_r|^2 / |y_r|^2), rows with y_r = 0 left out;
    also the worst row."""

    rows: int = 0
    sum_rel2: float = 0.0
    worst: float = 0.0

    def update(self, ref: torch.Tensor, p: torch.Tensor) -> None:
        """Rows a block at a time (at most :data:`~precision_audit.capture.stats.CHUNK` elements: its float64
        temporaries are ~40 bytes an element, which over a language model's logits set a GPU's peak); a tensor of one
        block is read as a whole, as before."""
        r_all = ref.detach().reshape(-1, ref.shape[-1]) if ref.dim() else ref.detach().reshape(1, 1)
        q_all = p.detach().reshape(r_all.shape)
        step = max(1, CHUNK // max(1, r_all.shape[1]))
        for i in range(0, r_all.shape[0], step):
            self._update_rows(r_all[i:i + step], q_all[i:i + step])

    def _update_rows(self, ref: torch.Tensor, p: torch.Tensor) -> None:
        r = ref.double()
        q = p.double()
        n2 = (r * r).sum(-1)
        d2 = ((q - r) ** 2).sum(-1)
        keep = (n2 > 0) & torch.isfinite(n2)
        if not bool(keep.any()):
            return
        rel2 = torch.where(torch.isfinite(d2[keep]), d2[keep] / n2[keep], torch.tensor(math.inf, dtype=torch.float64))
        self.rows += int(keep.sum())
        self.sum_rel2 += float(rel2.sum())
        self.worst = max(self.worst, float(rel2.max().sqrt()))

    @property
    def rel_l2(self) -> float:
        return math.sqrt(self.sum_rel2 / self.rows) if self.rows else 0.0


@dataclass
class RecipeLayerResult:
    local: dict[str, ErrorStats] = field(default_factory=dict)  # output / grad_input / grad_weight
    local_token: TokenError = field(default_factory=TokenError)  # forward output, per token
    accumulated: dict[str, ErrorStats] = field(default_factory=dict)  # output / grad_weight
    accumulated_token: TokenError = field(default_factory=TokenError)
    operands: dict[tuple[str, str], OperandStats] = field(default_factory=dict)
    loss_impact: float = 0.0  # first-order <dL/dy, y_p - y> of the local output error, summed over calls
    stale_steps: dict[str, list[int]] = field(default_factory=dict)  # delayed scaling, per tensor role


@dataclass
class LayerResult:
    name: str
    in_features: int
    out_features: int
    tokens: int = 0  # rows per call (batch x sequence), summed over calls
    calls: int = 0
    recipes: dict[str, RecipeLayerResult] = field(default_factory=dict)


@dataclass
class Fp8Result:
    recipes: tuple[str, ...]
    loss_fp32: float
    losses: dict[str, float | None]
    output_error: dict[str, ErrorStats]
    layers: list[LayerResult]
    history_steps: int
    notes: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    reference_outputs: list[torch.Tensor] = field(default_factory=list, repr=False)  # FP32 model outputs
    other_gemms: list[OtherGemm] = field(default_factory=list)  # matmul/bmm outside nn.Linear (fp8/other_gemms.py)


@dataclass
class _Call:
    x: torch.Tensor
    y: torch.Tensor
    gy: torch.Tensor | None = None


def measure_fp8(model: torch.nn.Module, forward: Callable[[torch.nn.Module], Any],
                loss_of: Callable[[Any], torch.Tensor], recipes: Iterable[str] = DEFAULT_RECIPES, *,
                device: str = "cpu", seed: int = 0, history_steps: int = 4) -> Fp8Result:
    """Measure each recipe on each ``nn.Linear`` of ``model`` (see the module docstring). ``forward(model)``
    runs the model on its batch, ``loss_of(output)`` gives a scalar loss. The model is put back as it was."""
    names = tuple(recipes)
    for n in names:
        if n not in RECIPES:
            from ..errors import OptionError
            raise OptionError(f"unknown FP8 recipe {n!r}", choices=list(RECIPES))
    if history_steps < 1:
        raise ValueError("history_steps must be >= 1")
    state = ModelState(model, device)
    state.prepare()
    try:
        return _measure(model, forward, loss_of, names, state, seed, history_steps)
    finally:
        state.restore()


def _linears(model: torch.nn.Module) -> dict[torch.nn.Linear, str]:
    return {m: n for n, m in named_modules(model) if isinstance(m, torch.nn.Linear)}


def _reset(model: torch.nn.Module, state: ModelState, seed: int) -> None:
    state.reset_buffers()
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    host_rng.seed(seed)  # np.random / random in the forward: the same draws in every measurement


def _history_note(history_steps: int) -> str:
    if history_steps > 1:
        return (f"delayed scaling: the amax history holds {history_steps - 1} earlier FP32 step(s) of the "
                "audited batch (weights unchanged between them, dropout drawn anew); step "
                f"{history_steps - 1} is the audited one")
    return ("delayed scaling: no earlier steps, so the audited step uses Transformer Engine's initial "
            "scale 1 (the first training step)")


def _measure(model, forward, loss_of, names, state, seed, history_steps) -> Fp8Result:
    linears = _linears(model)
    calls: dict[torch.nn.Linear, list[_Call]] = {m: [] for m in linears}

    # -- FP32 reference: every linear's inputs, outputs and output gradients, per call
    def rec_hook(m, args, out):
        if not args or not isinstance(args[0], torch.Tensor) or not isinstance(out, torch.Tensor):
            return
        c = _Call(args[0].detach().clone(), out.detach().clone())
        calls[m].append(c)
        if out.requires_grad:
            def grab(g, c=c):
                c.gy = g.detach().clone()
            out.register_hook(grab)

    _reset(model, state, seed)
    hooks = [m.register_forward_hook(rec_hook) for m in linears]
    try:
        out = forward(model)
        loss = loss_of(out)
        ref_out = [t.detach().clone() for t in float_tensors(out)]
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    loss_fp32 = float(loss.detach())
    ref_wgrad = {m: (m.weight.grad.detach().clone() if m.weight.grad is not None else None) for m in linears}

    layers = {m: LayerResult(name, m.in_features, m.out_features, sum(c.x.numel() // max(1, c.x.shape[-1])
                                                                    for c in calls[m]), len(calls[m]))
              for m, name in linears.items()}
    notes = [_history_note(history_steps)]

    # -- delayed scaling: amax histories from earlier steps of the same batch (other dropout draws)
    histories = _amax_histories(model, forward, loss_of, linears, state, seed, history_steps - 1)

    def fresh_state(recipe: Recipe, m) -> Fp8State:
        st = Fp8State(recipe)
        if any(c.kind == "delayed" for c in recipe.casts.values()):
            for role, dtype in (("input", recipe.cast("output", "input").dtype),
                                ("weight", recipe.cast("output", "weight").dtype),
                                ("grad_output", recipe.cast("grad_input", "grad_output").dtype)):
                assert dtype is not None  # delayed casts are FP8 (fp8/recipes.py)
                sc = st.scaler(role, dtype)
                for a in histories.get(m, {}).get(role, []):
                    sc.observe(a)
        return st

    losses: dict[str, float | None] = {}
    out_err: dict[str, ErrorStats] = {}
    errors: dict[str, str] = {}
    for rname in names:
        recipe = RECIPES[rname]
        # local: each module alone on its FP32 inputs
        for m, L in layers.items():
            res = L.recipes.setdefault(rname, RecipeLayerResult())
            st = fresh_state(recipe, m)
            for c in calls[m]:
                _local(m, c, st, res)
            res.operands = st.stats
            if st.scalers:
                res.stale_steps = {r: list(s.stale_steps) for r, s in st.scalers.items()}
        # accumulated: every linear under the recipe at once
        try:
            lval, oerr = _accumulated(model, forward, loss_of, linears, layers, calls, ref_wgrad, ref_out, rname,
                                      {m: fresh_state(recipe, m) for m in linears}, state, seed)
            losses[rname], out_err[rname] = lval, oerr
        except Exception as e:  # the model fails under the recipe: reported, not fatal
            losses[rname] = None
            errors[rname] = f"{type(e).__name__}: {e}"
    # GEMMs outside nn.Linear: one more FP32 forward with the same seed, each matmul/bmm measured where it runs
    _reset(model, state, seed)
    others = measure_other_gemms(model, lambda: forward(model), names)
    return Fp8Result(names, loss_fp32, losses, out_err, list(layers.values()), history_steps, notes, errors, ref_out,
                     others)


def _local(m: torch.nn.Linear, c: _Call, st: Fp8State, res: RecipeLayerResult) -> None:
    w = m.weight.detach().float()
    b = m.bias.detach().float() if m.bias is not None else None
    x = c.x.detach().float().clone().requires_grad_(True)  # a copy: the stored input must not gather gradients
    wq = w.clone().requires_grad_(True)
    with torch.enable_grad():
        y = fp8_linear(x, wq, b, st)
    res.local.setdefault("output", ErrorStats()).update(c.y, y)
    res.local_token.update(c.y, y)
    if c.gy is None:
        return
    y.backward(c.gy.float())
    go = c.gy.float().reshape(-1, c.gy.shape[-1])
    x2 = c.x.float().reshape(-1, c.x.shape[-1])
    ref_gx = (go @ w).reshape(c.x.shape)
    ref_gw = go.t() @ x2
    assert x.grad is not None and wq.grad is not None  # both require grad and feed y
    res.local.setdefault("grad_input", ErrorStats()).update(ref_gx, x.grad)
    res.local.setdefault("grad_weight", ErrorStats()).update(ref_gw, wq.grad)
    d = torch.where(torch.isfinite(c.y), y.detach() - c.y, 0.0)
    res.loss_impact += float((c.gy.double() * d.double()).sum())


def _accumulated(model, forward, loss_of, linears, layers, calls, ref_wgrad, ref_out, rname, states, mstate,
                 seed) -> tuple[float, ErrorStats]:
    index: dict[torch.nn.Module, int] = {}

    def cmp_hook(m, args, out):
        k = index.get(m, 0)
        index[m] = k + 1
        refs = calls[m]
        if k < len(refs) and isinstance(out, torch.Tensor) and out.shape == refs[k].y.shape:
            res = layers[m].recipes[rname]
            res.accumulated.setdefault("output", ErrorStats()).update(refs[k].y, out)
            res.accumulated_token.update(refs[k].y, out)

    _reset(model, mstate, seed)
    hooks = [m.register_forward_hook(cmp_hook) for m in linears]
    try:
        with patched(states):
            out = forward(model)
            loss = loss_of(out)
            loss.backward()
    finally:
        for h in hooks:
            h.remove()
    for m in linears:
        if ref_wgrad[m] is not None and m.weight.grad is not None:
            layers[m].recipes[rname].accumulated.setdefault("grad_weight", ErrorStats()).update(ref_wgrad[m],
                                                                                               m.weight.grad)
    oerr = ErrorStats()
    for r, y in zip(ref_out, float_tensors(out)):
        if r.shape == y.shape:
            oerr.update(r, y)
    return float(loss.detach()), oerr


def _amax_histories(model, forward, loss_of, linears, state, seed, steps) -> dict:
    """amax of each linear's input, weight and output gradient at ``steps`` FP32 steps (seeds seed+1...)."""
    hist: dict[torch.nn.Module, dict[str, list[float]]] = {m: {"input": [], "weight": [], "grad_output": []}
                                                         for m in linears}
    if steps <= 0:
        return hist
    cur: dict[torch.nn.Module, dict[str, float]] = {}

    def hook(m, args, out):
        d = cur.setdefault(m, {"input": 0.0, "weight": 0.0, "grad_output": 0.0})
        if args and isinstance(args[0], torch.Tensor):
            d["input"] = max(d["input"], float(args[0].detach().abs().max()) if args[0].numel() else 0.0)
        d["weight"] = max(d["weight"], float(m.weight.detach().abs().max()))
        if isinstance(out, torch.Tensor) and out.requires_grad:
            def grab(g, d=d):
                d["grad_output"] = max(d["grad_output"], float(g.detach().abs().max()) if g.numel() else 0.0)
            out.register_hook(grab)

    hooks = [m.register_forward_hook(hook) for m in linears]
    try:
        for i in range(steps):
            cur.clear()
            _reset(model, state, seed + 1 + i)
            loss = loss_of(forward(model))
            loss.backward()
            for m, d in cur.items():
                for role, a in d.items():
                    hist[m][role].append(a)
    finally:
        for h in hooks:
            h.remove()
        for p in model.parameters():
            p.grad = None
    return hist


# -- audit.json ----------------------------------------------------------------------------------------------

def _metrics(errors: dict[str, ErrorStats]) -> dict[str, Fp8Metrics | None]:
    return {k: metrics_record(v) for k, v in errors.items()}


def _layer_recipe(res: RecipeLayerResult, budget_rel_error: float) -> Fp8LayerRecipe:
    local_out = res.local.get("output")
    worst = max(local_out.rel_l2 if local_out else 0.0, res.local_token.rel_l2)
    return Fp8LayerRecipe(
        local=_metrics(res.local),
        local_per_token_rel_l2=res.local_token.rel_l2,
        local_worst_token_rel_l2=res.local_token.worst,
        accumulated=_metrics(res.accumulated),
        accumulated_per_token_rel_l2=res.accumulated_token.rel_l2,
        operands={f"{g}.{role}": s.to_record() for (g, role), s in sorted(res.operands.items())},
        loss_impact=res.loss_impact,
        stale_steps=res.stale_steps or None,
        meets_budget=bool(math.isfinite(worst) and worst <= budget_rel_error),
    )


def result_record(r: Fp8Result, budget_rel_error: float) -> Fp8:
    """The ``fp8`` section of audit.json, measured (docs/fp8.md, "What is measured"); fp8/audit.py adds the plan."""
    layers = [Fp8Layer(name=L.name, in_features=L.in_features, out_features=L.out_features, tokens=L.tokens,
                       calls=L.calls, recipes={n: _layer_recipe(res, budget_rel_error) for n, res in L.recipes.items()})
              for L in r.layers]
    return Fp8(
        recipes={n: Fp8RecipeInfo(description=RECIPES[n].description, source=RECIPES[n].source,
                                  min_compute_capability=list(RECIPES[n].min_cc),
                                  torchao_recipe=RECIPES[n].torchao_recipe) for n in r.recipes},
        budget=Fp8Budget(max_local_rel_error=budget_rel_error,
                         rule="a layer meets the budget under a recipe when both its local output rel_l2 and its "
                              "per-token rel_l2 are at most this"),
        loss_fp32=r.loss_fp32,
        loss=r.losses,
        output_error=_metrics(r.output_error),
        history_steps=r.history_steps,
        layers=layers,
        notes=r.notes,
        errors=r.errors,
        other_gemms=other_gemms_record(r.other_gemms, budget_rel_error, r.recipes),
    )
