"""The loss the audit differentiates, resolved in a fixed order from one FP32 forward.

1. ``loss_fn(output, batch)`` defined in the model file;
2. the model's own ``output.loss`` (Hugging Face models given labels);
3. cross-entropy or MSE inferred from the batch's target;
4. a deterministic surrogate: the mean of <y, r> over the floating outputs, r fixed (seed 0).

Example::

    spec = resolve_loss(source, model(*batch.args, **batch.kwargs), batch)
    spec.kind                # LossKind.CROSS_ENTROPY
    loss = spec(output, batch)   # float32 scalar
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F

from precision_audit.errors import LossError

from .batch import Batch
from .failures import exception_text, raise_site, type_name
from .model import ModelSource
from .nested import dtype_name, floating_leaves, output_structure

logger = logging.getLogger(__name__)

__all__ = ["LossKind", "LossSpec", "resolve_loss"]

#: F.cross_entropy's default ``ignore_index`` (also Hugging Face's label padding value).
_IGNORE_INDEX = -100

#: Seed of the surrogate loss's fixed random direction r.
_SURROGATE_SEED = 0


class LossKind(str, enum.Enum):
    """How the loss is computed. Compares equal to its string value (``LossKind.MSE == "mse"``)."""

    LOSS_FN = "loss_fn"
    OUTPUT_LOSS = "output.loss"
    CROSS_ENTROPY = "cross_entropy"
    MSE = "mse"
    SURROGATE = "surrogate"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class LossSpec:
    """The loss the audit differentiates, and why it was chosen.

    Calling it returns a float32 scalar tensor. CE and MSE run on the output as it is (under autocast these
    ops follow autocast's own dtype policy) and the result is upcast.

    Example::

        spec = resolve_loss(source, output, batch)
        spec.kind           # LossKind.CROSS_ENTROPY (== "cross_entropy")
        spec.description    # 'cross-entropy inferred from an integer target of shape [32] ...'
        loss = spec(model(*batch.args, **batch.kwargs), batch)
        loss.backward()
    """

    kind: LossKind
    description: str
    _compute: Callable[[Any, Batch], torch.Tensor] = field(repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", LossKind(self.kind))

    def __call__(self, output: Any, batch: Batch) -> torch.Tensor:
        loss = self._compute(output, batch).float()
        # the tensor itself when it is a float32 scalar already: the capture knows the loss by identity (a
        # module whose output is the loss, like DistilBERT's mlm_loss_fct, computes no gradient dL/dL)
        return loss if loss.dim() == 0 else loss.reshape(())


def resolve_loss(source: ModelSource, output: Any, batch: Batch) -> LossSpec:
    """Choose the loss for ``output`` (one FP32 forward of ``batch``), in this order.

    1. ``loss_fn(output, batch)`` defined in the model file (called with ``batch.raw``);
    2. ``output.loss`` / ``output["loss"]``, a scalar floating tensor (Hugging Face models given labels);
    3. with a target: cross-entropy for an integer target matching the logits ([N, C] / [N], [N, C, d...] /
       [N, d...], or [..., C] / [...]); MSE for a floating target of the output's shape;
    4. the one 0-dim floating tensor of a plain tuple the model returned (nanoGPT's ``logits, loss``);
    5. a surrogate, mean of <y, r> over every floating output tensor y, with r fixed (standard normal,
       seeded with 0): deterministic across calls and processes, and it gives every output a gradient.

    Raises :class:`~precision_audit.errors.LossError` when ``loss_fn`` fails or returns something other than a
    scalar floating tensor, or when the output holds no floating tensor at all.

    Example::

        >>> spec = resolve_loss(source, model(*batch.args), batch)      # doctest: +SKIP
        >>> spec.kind                                                     # doctest: +SKIP
        <LossKind.CROSS_ENTROPY: 'cross_entropy'>
    """
    user_fn = vars(source.module).get("loss_fn")
    if user_fn is not None:
        return _user_loss(source, user_fn, output, batch)

    if _output_loss(output) is not None:
        return LossSpec(LossKind.OUTPUT_LOSS, "output.loss computed by the model itself", _call_output_loss)

    reason = "no target and no loss defined"
    if isinstance(batch.target, torch.Tensor):
        spec, reason = _target_loss(output, batch.target)
        if spec is not None:
            logger.info("loss: %s", spec.description)
            return spec
        logger.warning("no standard loss fits the target: %s; using a surrogate loss", reason)

    slot = _tuple_loss_slot(output)
    if slot is not None:  # nanoGPT's (logits, loss): the model's own loss, not a surrogate of its outputs
        return LossSpec(LossKind.OUTPUT_LOSS, f"output[{slot}], the one scalar tensor in the tuple the model "
                        "returned: its own loss", functools.partial(_call_tuple_loss, slot))

    spec = _surrogate(output, reason, source)
    logger.info("loss: %s", spec.description)
    return spec


def _tuple_loss_slot(output: Any) -> int | None:
    """In a plain tuple or list the model returned (``return logits, loss``), the position of its one 0-dim
    floating tensor; None when there is no such element or more than one (which would be a guess)."""
    if not isinstance(output, (tuple, list)) or hasattr(output, "_fields"):
        return None
    slots = [i for i, v in enumerate(output)
             if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() == 0]
    return slots[0] if len(slots) == 1 else None


def _call_tuple_loss(slot: int, output: Any, batch: Batch) -> torch.Tensor:
    if _tuple_loss_slot(output) != slot:
        raise LossError(
            f"the model's output no longer has its one scalar tensor at output[{slot}]",
            expected=f"a tuple with one scalar floating tensor at output[{slot}], as in the first forward",
            found=output_structure(output),
        )
    return cast(torch.Tensor, output[slot])


def _user_loss(source: ModelSource, fn: Any, output: Any, batch: Batch) -> LossSpec:
    where = source.where
    if not callable(fn):
        raise LossError(
            f"loss_fn in {where} is not callable",
            expected="def loss_fn(output, batch): return <scalar tensor>",
            found=f"loss_fn is {type_name(fn)}",
        )
    try:
        value = fn(output, batch.raw)
    except Exception as e:
        user_file = str(source.path) if source.path is not None else getattr(source.module, "__file__", None)
        raise LossError(
            f"loss_fn(output, batch) in {where} raised {exception_text(e)}",
            expected="loss_fn(output, batch) to return a scalar floating tensor",
            found=raise_site(e, user_file) or f"{type(e).__name__} in loss_fn",
            hint=f"the output is {output_structure(output)}; the batch is {output_structure(batch.raw)}",
        ) from e
    _check_user_loss(value, where)

    def compute(out: Any, b: Batch) -> torch.Tensor:
        return _check_user_loss(fn(out, b.raw), where)

    return LossSpec(LossKind.LOSS_FN, f"loss_fn(output, batch) defined in {where}", compute)


def _check_user_loss(value: Any, where: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() == 1:
        return value
    if isinstance(value, torch.Tensor):
        found = f"a {dtype_name(value.dtype)} tensor of shape {list(value.shape)}"
    else:
        found = type_name(value)
    raise LossError(
        f"loss_fn(output, batch) in {where} did not return a scalar floating tensor",
        expected="a floating tensor with one element (e.g. F.cross_entropy(...) with reduction='mean')",
        found=found,
        hint="reduce per-sample losses with .mean(); return a tensor, not loss.item()",
    )


def _output_loss(output: Any) -> torch.Tensor | None:
    """``output["loss"]`` or ``output.loss`` when it is a scalar floating tensor, else None."""
    if isinstance(output, Mapping):
        value = output.get("loss")
    elif isinstance(output, torch.Tensor):
        return None
    else:
        value = getattr(output, "loss", None)
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() == 1:
        return value
    return None


def _call_output_loss(output: Any, batch: Batch) -> torch.Tensor:
    value = _output_loss(output)
    if value is None:
        raise LossError(
            "the model's output no longer has a scalar floating `loss`",
            expected="output.loss, as in the first forward",
            found=output_structure(output),
        )
    return value


def _primary_output(output: Any) -> tuple[str, torch.Tensor] | None:
    """The tensor a target is compared with: the output, its ``logits``, or its first element."""
    if isinstance(output, torch.Tensor):
        return "output", output
    if isinstance(output, Mapping):
        value = output.get("logits")
        return ("output['logits']", value) if isinstance(value, torch.Tensor) else None
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return "output.logits", logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return "output[0]", output[0]
    return None


def _target_loss(output: Any, target: torch.Tensor) -> tuple[LossSpec | None, str]:
    """A cross-entropy or MSE spec for ``target``, or None and the reason neither fits."""
    primary = _primary_output(output)
    target_text = f"the {dtype_name(target.dtype)} target of shape {list(target.shape)}"
    if primary is None:
        return None, f"{target_text} has no tensor output to compare with (output is {output_structure(output)})"
    where, y = primary
    if not y.is_floating_point():
        return None, f"{target_text} is compared with {where}, which is not floating point"
    integer = not (target.is_floating_point() or target.is_complex() or target.dtype == torch.bool)
    if integer:
        return _cross_entropy(where, y, target, target_text)
    if target.is_floating_point() and target.shape == y.shape:
        description = (
            f"MSE inferred from a floating target of the output's shape {list(y.shape)} (compared with {where})"
        )
        return LossSpec(LossKind.MSE, description, _MSE()), ""
    return None, f"{target_text} does not have the shape of {where} {list(y.shape)} (needed for MSE)"


def _cross_entropy(
    where: str, y: torch.Tensor, target: torch.Tensor, target_text: str
) -> tuple[LossSpec | None, str]:
    o, t = tuple(y.shape), tuple(target.shape)
    layouts: list[tuple[str, int]] = []
    if len(o) >= 2 and t == (o[0], *o[2:]):
        layouts.append(("dim1", o[1]))  # [N, C] / [N] and [N, C, d...] / [N, d...]: F.cross_entropy as is
    if len(o) >= 3 and t == o[:-1]:
        layouts.append(("last", o[-1]))  # [..., C] / [...]: logits [B, T, V] with target [B, T]
    if not layouts:
        return None, (
            f"{target_text} matches no cross-entropy layout of {where} {list(o)} "
            "([N, C] with [N], [N, C, d...] with [N, d...], or [..., C] with [...])"
        )
    labels = target[target != _IGNORE_INDEX]
    if labels.numel():
        low, high = int(labels.min()), int(labels.max())
        in_range = [(layout, c) for layout, c in layouts if low >= 0 and high < c]
        if not in_range:
            sizes = " or ".join(str(c) for _, c in layouts)
            return None, f"{target_text} has class indices {low}..{high}, outside the {sizes} classes of {where}"
        layouts = in_range
    layout, classes = layouts[0]  # both fit only when the sizes coincide; PyTorch's [N, C, ...] layout wins
    axis = "along dim 1" if layout == "dim1" else "in the last dimension, flattened"
    description = (
        f"cross-entropy inferred from an integer target of shape {list(t)} "
        f"({classes} classes {axis} of {where} {list(o)})"
    )
    return LossSpec(LossKind.CROSS_ENTROPY, description, _CrossEntropy(layout)), ""


class _CrossEntropy:
    def __init__(self, layout: str) -> None:
        self.layout = layout

    def __call__(self, output: Any, batch: Batch) -> torch.Tensor:
        y = _require_primary(output)
        target = cast(torch.Tensor, batch.target)  # resolve_loss chose this loss for a tensor target
        if self.layout == "last":
            return F.cross_entropy(y.reshape(-1, y.shape[-1]), target.reshape(-1))
        return F.cross_entropy(y, target)


class _MSE:
    def __call__(self, output: Any, batch: Batch) -> torch.Tensor:
        return F.mse_loss(_require_primary(output), cast(torch.Tensor, batch.target))


def _require_primary(output: Any) -> torch.Tensor:
    primary = _primary_output(output)
    if primary is None:
        raise LossError(
            "the model's output changed structure: no tensor to compare the target with",
            expected="the same structure as the first forward",
            found=output_structure(output),
        )
    return primary[1]


def _surrogate(output: Any, reason: str, source: ModelSource) -> LossSpec:
    leaves = [(name, t) for name, t in floating_leaves(output, "output") if t.numel() > 0]
    if not leaves:
        raise LossError(
            "the model's output contains no floating-point tensor, so no loss can be formed",
            expected="a floating tensor (or a tuple/dict/ModelOutput holding some) to differentiate",
            found=output_structure(output),
            hint=f"define loss_fn(output, batch) in {source.where} returning a scalar tensor",
        )
    surrogate = _Surrogate()
    for _, t in leaves:
        surrogate.direction(tuple(t.shape), torch.device("cpu"))  # drawn once, at resolve time
    description = (
        "surrogate: mean of <y, r> over the floating outputs with a fixed random r "
        f"({reason}; {len(leaves)} tensor{'s' if len(leaves) != 1 else ''}: "
        f"{', '.join(name for name, _ in leaves[:4])}{', ...' if len(leaves) > 4 else ''})"
    )
    return LossSpec(LossKind.SURROGATE, description, surrogate)


class _Surrogate:
    """sum over floating outputs y of <y.float(), r> / y.numel(), r ~ N(0, 1) fixed per shape (seed 0)."""

    def __init__(self) -> None:
        self._cpu: dict[tuple[int, ...], torch.Tensor] = {}
        self._moved: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}

    def direction(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        if shape not in self._cpu:
            generator = torch.Generator(device="cpu").manual_seed(_SURROGATE_SEED)
            self._cpu[shape] = torch.randn(shape, generator=generator, dtype=torch.float32)
        if device.type == "cpu":
            return self._cpu[shape]
        key = (shape, device)
        if key not in self._moved:
            self._moved[key] = self._cpu[shape].to(device)
        return self._moved[key]

    def __call__(self, output: Any, batch: Batch) -> torch.Tensor:
        leaves = [t for _, t in floating_leaves(output, "output") if t.numel() > 0]
        if not leaves:
            raise LossError(
                "the model's output contains no floating-point tensor",
                expected="the same structure as the first forward",
                found=output_structure(output),
            )
        total = self._term(leaves[0])
        for y in leaves[1:]:
            total = total + self._term(y)
        return total

    def _term(self, y: torch.Tensor) -> torch.Tensor:
        return (y.float() * self.direction(tuple(y.shape), y.device)).sum() / y.numel()
