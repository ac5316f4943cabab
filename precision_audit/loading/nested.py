"""Walking nested values: the tensors of a batch or a model output held in tuples, lists, dicts (Hugging Face
``ModelOutput`` too) and dataclasses, each named by its path (``args[0]``, ``output['logits']``).

Example::

    >>> [name for name, _ in named_tensors({"x": torch.zeros(2)}, "batch")]
    ["batch['x']"]
    >>> output_structure((torch.zeros(2),) * 3)
    'tuple(3 x Tensor[2])'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["check_nesting", "dtype_name", "floating_leaves", "map_tensors", "named_tensors", "output_structure"]

#: How deep a batch's containers may nest (a Hugging Face batch is a dict of tensors: depth 1). Every walk over a
#: batch recurses once per level; past Python's recursion limit (1000 frames) it would raise RecursionError.
MAX_DEPTH = 64


def check_nesting(value: Any, label: str) -> None:
    """Refuse a batch whose tuples, lists and dicts nest more than :data:`MAX_DEPTH` deep, or hold themselves
    (:class:`~precision_audit.errors.BatchError`), before anything walks it recursively. Iterative: any depth."""
    from ..errors import BatchError

    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Any = list(item.values())
        elif isinstance(item, (tuple, list)):
            children = item
        else:
            continue
        if depth >= MAX_DEPTH:
            raise BatchError(f"the batch from {label} nests containers more than {MAX_DEPTH} deep",
                             expected=f"tensors in tuples, lists and dicts at most {MAX_DEPTH} levels deep",
                             found=f"{type(item).__name__} inside {depth} levels of containers (or a container "
                                   "that holds itself)",
                             hint="pass the batch your training step feeds the model: (inputs..., target) or a "
                                  "dict of keyword inputs")
        stack.extend((c, depth + 1) for c in children)


def named_tensors(value: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in ``value`` (tensors, dicts, tuples and lists, nested), named by its path: ``args[0][1]``."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from named_tensors(item, f"{name}[{key!r}]")
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from named_tensors(item, f"{name}[{i}]")


def map_tensors(value: Any, device: torch.device | str, memo: dict[int, torch.Tensor]) -> Any:
    """``value`` with every tensor moved to ``device``, containers rebuilt as their own type; ``memo`` (by id)
    moves a tensor that appears twice once, so it stays shared."""
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = value.to(device)
        return memo[id(value)]
    if isinstance(value, Mapping):
        items = {k: map_tensors(v, device, memo) for k, v in value.items()}
        try:
            return type(value)(items)  # type: ignore[call-arg]  # a dict subclass or ModelOutput takes one
        except TypeError:  # a Mapping that cannot be built from a dict
            return items
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(map_tensors(v, device, memo) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(v, device, memo) for v in value)
    return value


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"`` (the name in messages and in audit.json's batch description)."""
    return str(dtype).removeprefix("torch.")


def floating_leaves(value: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The floating-point tensors of a model output (dicts, ModelOutput, tuples, lists, dataclasses), with their
    path: ``output['logits']``."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield name, value
    elif isinstance(value, Mapping):  # dicts and Hugging Face ModelOutput
        for key, item in value.items():
            yield from floating_leaves(item, f"{name}[{key!r}]")
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from floating_leaves(item, f"{name}[{i}]")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from floating_leaves(getattr(value, f.name), f"{name}.{f.name}")


def output_structure(output: Any) -> str:
    """A short signature of a (nested) output, to tell whether two forwards returned the same structure.

    Shapes are included, dtypes are not (they differ between formats by design). Runs of equal items are
    collapsed, so 24 layers of key/value caches stay one line.

    Example::

        >>> output_structure(torch.zeros(4, 32, 257))
        'Tensor[4,32,257]'
        >>> output_structure({"logits": torch.zeros(2, 3), "loss": torch.tensor(1.0)})
        'dict(logits: Tensor[2,3], loss: Tensor[])'
        >>> output_structure((torch.zeros(2),) * 3)
        'tuple(3 x Tensor[2])'
    """
    if isinstance(output, torch.Tensor):
        return f"Tensor[{','.join(str(s) for s in output.shape)}]"
    if isinstance(output, Mapping):
        items = ", ".join(f"{k}: {output_structure(v)}" for k, v in output.items())
        return f"{type(output).__name__}({items})"
    if isinstance(output, (tuple, list)):
        return f"{type(output).__name__}({_collapse([output_structure(v) for v in output])})"
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        items = ", ".join(
            f"{f.name}: {output_structure(getattr(output, f.name))}" for f in dataclasses.fields(output)
        )
        return f"{type(output).__name__}({items})"
    if output is None:
        return "None"
    return type(output).__name__


def _collapse(parts: list[str]) -> str:
    runs: list[tuple[str, int]] = []
    for part in parts:
        if runs and runs[-1][0] == part:
            runs[-1] = (part, runs[-1][1] + 1)
        else:
            runs.append((part, 1))
    return ", ".join(part if count == 1 else f"{count} x {part}" for part, count in runs)
