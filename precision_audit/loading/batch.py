"""BATCH: a ``torch.save`` file (or the model file's ``sample_batch()``) split into what the forward takes and
the target.

A tensor is the one positional input; a dict is keyword inputs; a tuple/list is split with the forward's
signature (``inputs...``, ``(inputs..., target)``, ``((a, b), target)``, ``(dict, target)``). The file is always
loaded with ``weights_only=True``: precision-audit never unpickles arbitrary code.

Example::

    batch = load_batch("sample.pt", model, source)   # saved as (x, y)
    output = model(*batch.args, **batch.kwargs)
    batch.target                                     # y
"""

from __future__ import annotations

import inspect
import logging
import math
import pickle
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from precision_audit.errors import BatchError

from .failures import exception_text, raise_site, type_name
from .model import ModelSource
from .nested import check_nesting, dtype_name, map_tensors, named_tensors, output_structure

logger = logging.getLogger(__name__)

__all__ = ["Batch", "load_batch"]


@dataclass(frozen=True)
class Batch:
    """One sample batch, split into what the forward takes and the target.

    ``model(*batch.args, **batch.kwargs)`` runs the model; ``batch.raw`` is the object exactly as loaded (what a
    user ``loss_fn(output, batch)`` receives).

    Example::

        batch = load_batch("sample.pt", model, source)   # saved as (x, y)
        batch.args          # (tensor of shape [32, 64],)
        batch.target        # tensor of shape [32]
        batch.describe()    # [{"name": "args[0]", "shape": [32, 64], "dtype": "float32"},
                            #  {"name": "target", "shape": [32], "dtype": "int64"}]
    """

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    target: Any | None
    raw: Any
    source: str
    #: What the audit added to the forward call on its own, for the report (e.g. ``use_cache=False``).
    notes: tuple[str, ...] = ()

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor with its name: ``args[0]``, a kwargs key, ``target`` (nested: ``args[0][1]``)."""
        for i, value in enumerate(self.args):
            yield from named_tensors(value, f"args[{i}]")
        for key, value in self.kwargs.items():
            yield from named_tensors(value, key)
        if self.target is not None:
            yield from named_tensors(self.target, "target")

    def describe(self) -> list[dict[str, Any]]:
        """Name, shape and dtype of every tensor (inputs, keyword inputs and target), for reports and JSON."""
        return [
            {"name": name, "shape": list(t.shape), "dtype": dtype_name(t.dtype)} for name, t in self.tensors()
        ]

    def to(self, device: torch.device | str) -> Batch:
        """A copy with every tensor moved to ``device`` (``args``, ``kwargs``, ``target`` and ``raw`` alike).

        A tensor shared between ``raw`` and ``args`` is moved once and stays shared.
        """
        memo: dict[int, torch.Tensor] = {}
        return Batch(
            args=tuple(map_tensors(a, device, memo) for a in self.args),
            kwargs={k: map_tensors(v, device, memo) for k, v in self.kwargs.items()},
            target=map_tensors(self.target, device, memo),
            raw=map_tensors(self.raw, device, memo),
            source=self.source,
            notes=self.notes,
        )


def load_batch(path: str | Path | None, model: nn.Module, source: ModelSource) -> Batch:
    """Load BATCH (or the model file's ``sample_batch()`` when ``path`` is None) and split it for ``model``.

    A tensor is the one positional input. A dict is keyword inputs. A tuple/list is split with the forward's
    signature: all positional inputs if ``model.forward`` accepts that many, else ``(inputs..., target)`` if it
    accepts one fewer; ``((a, b), target)`` and ``(dict, target)`` are recognised too. Every user mistake
    (missing or unreadable file, Python objects in the pickle, empty or non-finite tensors, a batch the forward
    cannot take) raises :class:`~precision_audit.errors.BatchError`. A forward with a ``use_cache`` parameter
    (Hugging Face models) is called with ``use_cache=False`` unless the batch sets it; ``batch.notes`` says so.

    Example::

        >>> torch.save((torch.randn(8, 4), torch.randint(0, 3, (8,))), "sample.pt")   # doctest: +SKIP
        >>> batch = load_batch("sample.pt", model, source)                          # doctest: +SKIP
        >>> batch.target.shape                                                      # doctest: +SKIP
        torch.Size([8])
    """
    if path is None:
        raw, label = _sample_batch(source)
    else:
        file = Path(path).expanduser()
        raw, label = _load_batch_file(file), str(path)
    batch = _interpret(raw, model, label)
    logger.info(
        "batch from %s: %s",
        label,
        ", ".join(f"{d['name']} {d['dtype']}{d['shape']}" for d in batch.describe()),
    )
    return batch


def _sample_batch(source: ModelSource) -> tuple[Any, str]:
    fn = vars(source.module).get("sample_batch")
    if fn is None:
        raise BatchError(
            "--batch is required: no batch file given and the model file defines no sample_batch()",
            expected="--batch FILE (written by torch.save), or sample_batch() in " + source.where,
            hint="save one batch with torch.save((inputs, target), 'sample.pt') and pass --batch sample.pt",
        )
    label = f"sample_batch() in {source.where}"
    if not callable(fn):
        raise BatchError(
            f"sample_batch in {source.where} is not callable",
            expected="def sample_batch(): return <tensor, tuple or dict>",
            found=f"sample_batch is {type_name(fn)}",
        )
    try:
        raw = fn()
    except Exception as e:
        user_file = str(source.path) if source.path is not None else getattr(source.module, "__file__", None)
        raise BatchError(
            f"{label} raised {exception_text(e)}",
            expected="sample_batch() to return a tensor, a tuple/list or a dict of tensors",
            found=raise_site(e, user_file) or f"{type(e).__name__} in sample_batch()",
        ) from e
    return raw, label


def _load_batch_file(file: Path) -> Any:
    if not file.exists():
        raise BatchError(
            f"batch file not found: {file}",
            expected="a file written by torch.save",
            found=f"no file at {file.absolute()}",
            hint="check the path (it is relative to the current directory)",
        )
    if file.is_dir():
        raise BatchError(
            f"--batch is a directory, not a file: {file}",
            expected="a single file written by torch.save",
            found=f"the directory {file}",
        )
    try:
        with warnings.catch_warnings():
            # A plain pickle triggers a protocol warning before failing; the error below explains it better.
            warnings.filterwarnings("ignore", message=".*pickle protocol.*")
            return torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        found_class = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        if found_class:
            name = found_class.group(1)
            hint = (
                "re-save the batch with plain tensors, tuples, lists and dicts, "
                "e.g. torch.save((x, y), 'sample.pt'); precision-audit never unpickles arbitrary code"
            )
            if name.startswith("numpy"):
                hint = "convert numpy arrays with torch.from_numpy(a) and " + hint
            raise BatchError(
                f"the batch file {file} contains Python objects other than tensors and containers, "
                "which torch.load(weights_only=True) refuses",
                expected="tensors in tuples, lists or dicts (str keys), as torch.save writes them",
                found=f"an object of class {name}",
                hint=hint,
            ) from e
        raise _not_a_torch_file(file, e) from e
    except PermissionError as e:
        raise BatchError(f"cannot read the batch file {file}", found=str(e)) from e
    except Exception as e:  # torch raises RuntimeError, KeyError, EOFError... for files it cannot parse
        raise _not_a_torch_file(file, e) from e


def _not_a_torch_file(file: Path, e: BaseException) -> BatchError:
    with open(file, "rb") as f:
        head = f.read(512)
    if head.startswith(b"PK\x03\x04"):
        content = "a zip archive that torch.load cannot read (truncated or corrupted?)"
    elif not head:
        content = "an empty file"
    elif _is_text(head):
        content = "a text file"
    else:
        content = "binary data that is not a torch.save archive"
    detail = _first_line(str(e))
    if detail.startswith("Weights only load failed"):
        # torch's own text goes on to suggest weights_only=False, which precision-audit never does.
        detail = "not a pickle torch.load(weights_only=True) can read"
    return BatchError(
        f"the batch file {file} is not a torch.save file",
        expected="a file written by torch.save (loaded with torch.load(weights_only=True))",
        found=f"{content} ({type(e).__name__}: {detail})" if detail else f"{content} ({type(e).__name__})",
        hint="save one batch with torch.save(batch, 'sample.pt')",
    )


def _is_text(head: bytes) -> bool:
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return b"\x00" not in head


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:200]


@dataclass(frozen=True)
class _ForwardArity:
    """What ``model.forward`` accepts: positional count range and keyword names."""

    required: int
    maximum: float  # math.inf with *args
    keywords: frozenset[str]
    required_keywords: frozenset[str]
    var_keyword: bool
    text: str

    def fits(self, n: int) -> bool:
        return self.required <= n <= self.maximum

    def describe_count(self) -> str:
        if self.maximum == math.inf:
            return f"at least {self.required} positional input{'s' if self.required != 1 else ''}"
        if self.required == self.maximum:
            return f"{self.required} positional input{'s' if self.required != 1 else ''}"
        return f"{self.required} to {int(self.maximum)} positional inputs"


def _forward_arity(model: nn.Module) -> _ForwardArity:
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        logger.debug("cannot read the signature of %s.forward; assuming it takes anything", type(model).__name__)
        return _ForwardArity(0, math.inf, frozenset(), frozenset(), True, "forward(*args, **kwargs)")
    P = inspect.Parameter
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    keywords = [p for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)]
    return _ForwardArity(
        required=sum(p.default is p.empty for p in positional),
        maximum=math.inf if any(p.kind is P.VAR_POSITIONAL for p in params) else len(positional),
        keywords=frozenset(p.name for p in keywords),
        required_keywords=frozenset(p.name for p in keywords if p.default is p.empty),
        var_keyword=any(p.kind is P.VAR_KEYWORD for p in params),
        text=f"{type(model).__name__}.forward{_plain_signature(signature)}",
    )


def _plain_signature(signature: inspect.Signature) -> inspect.Signature:
    """The signature without annotations: ``(x, mask=None)`` reads better in a message."""
    params = [p.replace(annotation=p.empty) for p in signature.parameters.values()]
    return signature.replace(parameters=params, return_annotation=inspect.Signature.empty)


def _interpret(raw: Any, model: nn.Module, label: str) -> Batch:
    check_nesting(raw, label)
    arity = _forward_arity(model)
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}
    target: Any | None = None

    if isinstance(raw, torch.Tensor):
        if not arity.fits(1):
            raise BatchError(
                f"the batch from {label} is a single tensor, but {arity.text} takes {arity.describe_count()}",
                expected=f"{arity.describe_count()} (save them as a tuple)",
                found=f"one tensor of shape {list(raw.shape)}",
            )
        args = (raw,)
    elif isinstance(raw, Mapping):
        kwargs = _keyword_inputs(raw, arity, label)
    elif isinstance(raw, (tuple, list)):
        if len(raw) == 0:
            raise _empty_batch(label, f"an empty {type(raw).__name__}")
        args, kwargs, target = _split_sequence(raw, arity, label)
    else:
        raise BatchError(
            f"the batch from {label} holds no tensor",
            expected="a tensor, a tuple/list of tensors (inputs..., target), or a dict of keyword tensors",
            found=type_name(raw),
        )

    notes: tuple[str, ...] = ()
    if _takes_use_cache(model, len(args)) and "use_cache" not in kwargs:
        # A training step never reads the key/value cache, so building it only holds every layer's keys and
        # values a second time. The figures do not depend on it: the per-module re-runs copy a cache object as
        # the call found it (capture/call_args.py), and a random-init GPT-2 audited with use_cache=True gives
        # the same loss, output error and per-layer errors (issue 32; a model wrapped in another forward, as a
        # LightningModule, runs with its cache on). Hugging Face does the same under gradient checkpointing.
        kwargs = {**kwargs, "use_cache": False}
        notes = ("use_cache=False passed to forward: a training step reads no key/value cache, and the cache's "
                 "in-place updates would make the per-module re-runs see other inputs",)
        logger.info("batch from %s: %s", label, notes[0])
    batch = Batch(args=args, kwargs=kwargs, target=target, raw=raw, source=label, notes=notes)
    _check_tensors(batch, label)
    return batch


def _takes_use_cache(model: nn.Module, n_args: int) -> bool:
    """Whether ``model.forward`` names a ``use_cache`` parameter not already filled by the positional inputs."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    for i, p in enumerate(params):
        if p.name == "use_cache":
            if p.kind is inspect.Parameter.KEYWORD_ONLY:
                return True
            return p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and i >= n_args
    return False


def _keyword_inputs(raw: Mapping[Any, Any], arity: _ForwardArity, label: str) -> dict[str, Any]:
    if len(raw) == 0:
        raise _empty_batch(label, "an empty dict")
    bad_keys = [k for k in raw if not isinstance(k, str)]
    if bad_keys:
        raise BatchError(
            f"the batch from {label} is a dict with non-string keys",
            expected="a dict of keyword arguments for forward (str keys)",
            found=f"keys {bad_keys[:5]!r}",
        )
    if not arity.var_keyword:
        unknown = [k for k in raw if k not in arity.keywords]
        if unknown:
            raise BatchError(
                f"the batch from {label} has keys that {arity.text} does not take: {', '.join(unknown)}",
                expected="keys naming parameters of forward",
                found=f"keys {', '.join(raw)}",
                choices=sorted(arity.keywords),
                hint="if forward takes the whole dict as one argument, save the batch as (batch_dict,)",
            )
    missing = sorted(arity.required_keywords - set(raw))
    if missing:
        raise BatchError(
            f"the batch from {label} lacks required inputs of {arity.text}: {', '.join(missing)}",
            expected=f"keys for every required parameter: {', '.join(sorted(arity.required_keywords))}",
            found=f"keys {', '.join(raw)}",
        )
    return dict(raw)


def _split_sequence(
    raw: Sequence[Any], arity: _ForwardArity, label: str
) -> tuple[tuple[Any, ...], dict[str, Any], Any | None]:
    n = len(raw)
    first = raw[0]
    if n == 2 and isinstance(first, Mapping) and all(isinstance(k, str) for k in first):
        if arity.var_keyword or set(first) <= arity.keywords:
            logger.info("batch from %s read as (keyword inputs, target)", label)
            return (), _keyword_inputs(first, arity, label), raw[1]
    if n == 2 and isinstance(first, (tuple, list)) and arity.fits(len(first)):
        logger.info("batch from %s read as ((%d inputs), target)", label, len(first))
        return tuple(first), {}, raw[1]
    if arity.fits(n):
        if n > arity.required:
            logger.info(
                "batch from %s: all %d elements passed to %s as inputs (it accepts %s); "
                "save it as ((inputs...), target) if the last one is a target",
                label, n, arity.text, arity.describe_count(),
            )
        return tuple(raw), {}, None
    if n >= 2 and arity.fits(n - 1):
        logger.info("batch from %s read as (%d inputs, target)", label, n - 1)
        return tuple(raw[:-1]), {}, raw[-1]
    raise BatchError(
        f"{arity.text} takes {arity.describe_count()}, but the batch from {label} holds {n} elements",
        expected=f"a tuple of {arity.describe_count()}, optionally followed by the target",
        found=f"a {type(raw).__name__} of {n}: {', '.join(_short(v) for v in raw)}",
        hint="save the batch as (inputs..., target) or ((inputs...), target) matching forward, "
        "or as a dict of keyword arguments",
    )


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}"
    return type(value).__name__


def _empty_batch(label: str, what: str) -> BatchError:
    return BatchError(
        f"the batch from {label} is empty",
        expected="at least one input tensor with at least one element",
        found=what,
    )


def _check_tensors(batch: Batch, label: str) -> None:
    named = list(batch.tensors())
    if not named:
        raise BatchError(
            f"the batch from {label} holds no tensor",
            expected="at least one torch.Tensor among the inputs",
            found=output_structure(batch.raw),
            hint="convert lists and numpy arrays with torch.tensor(...) / torch.from_numpy(...) before saving",
        )
    meta = [name for name, t in named if t.is_meta]
    if meta:
        raise BatchError(
            f"the batch from {label} holds tensors on the meta device (shapes without values)",
            expected="input tensors that hold values (on the CPU; the audit moves them to --device)",
            found=f"on meta: {', '.join(meta[:5])}" + (", ..." if len(meta) > 5 else ""),
            hint="create the batch on the CPU, e.g. torch.randn(..., device='cpu'), and save it again",
        )
    empty = [f"{name} {list(t.shape)}" for name, t in named if t.numel() == 0]
    if empty:
        raise _empty_batch(label, f"tensors with no elements: {', '.join(empty)}")
    bad = []
    for name, t in named:
        if t.is_floating_point() or t.is_complex():
            nan = int(torch.isnan(t).sum())
            inf = int(torch.isinf(t).sum())
            if nan or inf:
                bad.append(f"{name}: {nan} NaN, {inf} Inf of {t.numel()}")
    if bad:
        raise BatchError(
            f"the batch from {label} contains non-finite values",
            expected="finite inputs (the audit compares against an FP32 reference, which must be finite)",
            found="; ".join(bad),
            hint="save a batch without NaN/Inf (check the data pipeline)",
        )
