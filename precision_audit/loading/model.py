"""Turn the user's MODEL and BATCH arguments into an ``nn.Module``, a :class:`Batch` and a loss.

MODEL is a path to a ``.py`` file that defines ``build_model()``, ``get_model()`` or a module-level ``model``
(looked for in that order; ``model.py:name`` picks another callable or attribute), or an importable
``package.module:name``. The file may also define ``loss_fn(output, batch)`` and ``sample_batch()``.

BATCH is a file written by ``torch.save``: a tensor, a tuple/list (``inputs...`` or ``(inputs, target)``), or a
dict of keyword arguments. It is always loaded with ``weights_only=True``: precision-audit never unpickles
arbitrary code.

The loss used for gradients is resolved in a fixed order: the file's ``loss_fn`` -> the model's own
``output.loss`` -> cross-entropy or MSE inferred from the batch's target -> a deterministic surrogate.

Example::

    model, source = load_model("model.py")
    batch = load_batch("sample.pt", model, source)
    output = model(*batch.args, **batch.kwargs)
    loss_spec = resolve_loss(source, output, batch)
    loss = loss_spec(output, batch)          # float32 scalar
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import hashlib
import importlib
import importlib.util
import inspect
import logging
import math
import os
import pickle
import re
import sys
import traceback
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from precision_audit.errors import BatchError, LossError, ModelLoadError, ModelRunError

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MODEL_NAMES",
    "Batch",
    "LossKind",
    "LossSpec",
    "ModelSource",
    "check_trainable",
    "load_batch",
    "load_model",
    "model_exit_error",
    "output_structure",
    "resolve_loss",
]

#: Names looked for in a model file, in this order, when MODEL has no ``:name`` suffix.
DEFAULT_MODEL_NAMES: tuple[str, ...] = ("build_model", "get_model", "model")

#: Optional hooks a model file may define; never offered as the model itself.
_ROLE_NAMES: frozenset[str] = frozenset({"loss_fn", "sample_batch"})

#: F.cross_entropy's default ``ignore_index`` (also Hugging Face's label padding value).
_IGNORE_INDEX = -100

#: Seed of the surrogate loss's fixed random direction r.
_SURROGATE_SEED = 0

_MODULE_PREFIX = "_precision_audit_user_model_"


# ---------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSource:
    """Where the model came from: the MODEL argument, the file, the attribute used and the imported module.

    Example::

        model, source = load_model("model.py:make_big")
        source.path        # PosixPath('/abs/model.py')
        source.attribute   # 'make_big'
        source.label       # 'make_big in model.py'
    """

    spec: str
    path: Path | None
    attribute: str
    module: types.ModuleType = field(repr=False)

    @property
    def where(self) -> str:
        """The file name (``model.py``) or module name (``pkg.mod``) for messages."""
        return self.path.name if self.path is not None else self.module.__name__

    @property
    def label(self) -> str:
        """``build_model in model.py`` or ``factory in pkg.mod``, for messages and reports."""
        return f"{self.attribute} in {self.where}"


def load_model(spec: str) -> tuple[nn.Module, ModelSource]:
    """Import MODEL and return the ``nn.Module`` it defines, with where it came from.

    ``spec`` is ``path/to/model.py`` (``build_model()``, ``get_model()`` or ``model``, in that order),
    ``path/to/model.py:name`` (another callable or attribute; dotted names such as ``Factory.create`` work), or
    ``package.module:name``. A callable (a factory or an ``nn.Module`` class) is called with no arguments.
    Every user mistake raises :class:`~precision_audit.errors.ModelLoadError`.

    A file is imported under a unique module name (``_precision_audit_user_model_<hash>``, left in
    ``sys.modules`` so that pickling and dataclasses in the file work); its folder is on ``sys.path`` only while
    the file is imported and the factory runs, so that it can import its sibling modules.

    Example::

        >>> model, source = load_model("sample_models/mlp.py")       # doctest: +SKIP
        >>> source.attribute                                          # doctest: +SKIP
        'build_model'
    """
    text = spec.strip()
    if not text:
        raise ModelLoadError(
            "no MODEL given",
            expected="a path to a .py file, or package.module:name",
            hint="pass e.g. model.py or model.py:build_model",
        )
    target, attribute = _split_spec(text)
    if _looks_like_path(target):
        return _load_from_file(text, Path(target).expanduser(), attribute)
    if attribute is None or not _is_dotted_identifier(target):
        raise ModelLoadError(
            f"MODEL {spec!r} is neither a .py file nor an importable package.module:name",
            expected="path/to/model.py, path/to/model.py:name, or package.module:name",
            found=spec,
            hint=_did_you_mean_file(target),
        )
    return _load_from_module(text, target, attribute)


def _split_spec(text: str) -> tuple[str, str | None]:
    """Split ``target:attribute``; a colon followed by a path (a Windows drive) is part of the path."""
    head, sep, tail = text.rpartition(":")
    if not sep or not head or "/" in tail or "\\" in tail:
        return text, None
    if not _is_dotted_identifier(tail):
        raise ModelLoadError(
            f"the part of MODEL after ':' is not a Python name: {tail!r}",
            expected="model.py:name or package.module:name, where name is a callable or attribute",
            found=text,
        )
    return head, tail


def _is_dotted_identifier(text: str) -> bool:
    return bool(text) and all(part.isidentifier() for part in text.split("."))


def _looks_like_path(target: str) -> bool:
    return (
        target.endswith(".py")
        or "/" in target
        or os.sep in target
        or Path(target).expanduser().exists()
    )


def _did_you_mean_file(target: str) -> str:
    candidate = Path(target + ".py")
    if candidate.is_file():
        return f"did you mean {candidate}?"
    return "give the path of the model file (ending in .py), or package.module:name for an installed package"


def _py_files_near(folder: Path, limit: int = 10) -> list[str]:
    """The .py files in ``folder`` (at most ``limit``), offered when MODEL names a missing file or a folder."""
    try:
        return sorted(p.name for p in folder.glob("*.py") if p.is_file())[:limit]
    except OSError:
        return []


def _load_from_file(spec: str, path: Path, attribute: str | None) -> tuple[nn.Module, ModelSource]:
    if not path.exists():
        raise ModelLoadError(
            f"model file not found: {path}",
            expected="an existing .py file",
            found=f"no file at {path.absolute()}",
            choices=_py_files_near(path.absolute().parent),
            hint="check the path (it is relative to the current directory)",
        )
    if path.is_dir():
        inside = _py_files_near(path)
        raise ModelLoadError(
            f"MODEL is a directory, not a .py file: {path}",
            expected="the path of a .py file defining build_model(), get_model() or model",
            found=f"the directory {path}",
            choices=inside,
            hint=f"pass one of its files, e.g. {path / inside[0]}" if inside else None,
        )
    if path.suffix != ".py":
        raise ModelLoadError(
            f"MODEL is not a .py file: {path}",
            expected="a .py file, or package.module:name",
            found=f"a file with suffix {path.suffix!r}" if path.suffix else "a file without a .py suffix",
            hint="the batch goes in --batch; MODEL is the Python file that builds the model",
        )
    path = path.resolve()
    with _on_sys_path(path.parent):
        module = _import_file(path)
        name, obj = _find_attribute(module, attribute, where=path.name, user_file=path)
        model = _instantiate(obj, name, where=path.name, user_file=str(path))
    source = ModelSource(spec=spec, path=path, attribute=name, module=module)
    logger.info("loaded %s from %s (%s)", type(model).__name__, source.label, path)
    return model, source


def _load_from_module(spec: str, module_name: str, attribute: str) -> tuple[nn.Module, ModelSource]:
    # The console script's sys.path[0] is its bin/ folder, not the current directory; put the current
    # directory on the path while importing, as `python -m` would.
    with _on_sys_path(Path.cwd()):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
                raise ModelLoadError(
                    f"cannot import module {module_name!r} (from MODEL {spec!r})",
                    expected="an importable package.module:name, or a path to a .py file",
                    found=f"ModuleNotFoundError: {e}",
                    hint="check the spelling, run from the folder that contains the package, "
                    "or install it (pip install -e .)",
                ) from e
            raise _import_failure(e, where=module_name, user_file=None) from e
        except SyntaxError as e:
            raise _syntax_failure(e, where=module_name) from e
        except (Exception, SystemExit) as e:
            raise _import_failure(e, where=module_name, user_file=None) from e
        user_file = getattr(module, "__file__", None)
        name, obj = _find_attribute(module, attribute, where=module_name, user_file=None)
        model = _instantiate(obj, name, where=module_name, user_file=user_file)
    source = ModelSource(spec=spec, path=None, attribute=name, module=module)
    logger.info("loaded %s from %s", type(model).__name__, source.label)
    return model, source


class _on_sys_path:
    """Put a folder first on ``sys.path`` for the duration of a ``with`` block, and take it off again."""

    def __init__(self, folder: Path) -> None:
        self._entry = str(folder)

    def __enter__(self) -> None:
        sys.path.insert(0, self._entry)

    def __exit__(self, *exc: object) -> None:
        # Remove the entry we added (normally still first), leaving any the user code added itself.
        if sys.path and sys.path[0] == self._entry:
            del sys.path[0]
        elif self._entry in sys.path:
            sys.path.remove(self._entry)


def _import_file(path: Path) -> types.ModuleType:
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"{_MODULE_PREFIX}{digest}"
    import_spec = importlib.util.spec_from_file_location(module_name, path)
    if import_spec is None or import_spec.loader is None:  # pragma: no cover - only for non-.py suffixes
        raise ModelLoadError(f"cannot import {path}", expected="a Python source file", found=str(path))
    module = importlib.util.module_from_spec(import_spec)
    # Registered before running it: dataclasses and pickling look the module up by name.
    sys.modules[module_name] = module
    try:
        import_spec.loader.exec_module(module)
    except SyntaxError as e:
        del sys.modules[module_name]
        raise _syntax_failure(e, where=path.name) from e
    except (Exception, SystemExit) as e:
        del sys.modules[module_name]
        raise _import_failure(e, where=path.name, user_file=str(path)) from e
    logger.debug("imported %s as module %s", path, module_name)
    return module


def _syntax_failure(e: SyntaxError, *, where: str) -> ModelLoadError:
    filename = Path(e.filename).name if e.filename else where
    line = (e.text or "").strip()
    return ModelLoadError(
        f"syntax error in {filename}, line {e.lineno}: {e.msg}",
        expected="a Python file that imports without errors",
        found=f"{filename}, line {e.lineno}: {line}" if line else f"{filename}, line {e.lineno}",
        hint=f"run `python {e.filename}` to see the error in context" if e.filename else None,
    )


def _import_failure(e: BaseException, *, where: str, user_file: str | None) -> ModelLoadError:
    if isinstance(e, SystemExit):
        return ModelLoadError(
            f"importing {where} raised {_exception_text(e)}: the file called sys.exit({e.code!r})",
            expected="a model file that imports without ending the process",
            found=_raise_site(e, user_file) or f"SystemExit while importing {where}",
            hint=_EXIT_HINT,
        )
    return ModelLoadError(
        f"importing {where} raised {_exception_text(e)}",
        expected="a model file that imports without errors",
        found=_raise_site(e, user_file) or f"{type(e).__name__} while importing {where}",
        hint="fix the error in the model file; it must be importable without command-line arguments",
    )


_EXIT_HINT = ("a model must return or raise, never end the process: remove the sys.exit() call, or move script "
              "code (argument parsing, training) under `if __name__ == '__main__':`")


def model_exit_error(e: SystemExit, model: str | None = None) -> ModelRunError:
    """The error for a ``sys.exit(n)`` that the user's code (forward, loss_fn, sample_batch...) called while
    the audit ran it: exit 2 with the file and line, instead of ending precision-audit with code ``n`` and no
    message (README.md, "Exit codes")."""
    frames = traceback.extract_tb(e.__traceback__)
    site = None
    if frames:
        f = frames[-1]
        site = f"{Path(f.filename).name}, line {f.lineno}" + (f": {f.line.strip()}" if f.line else "")
    return ModelRunError(
        f"the model called sys.exit({e.code!r}) while precision-audit ran it, so the audit stopped",
        expected=f"the code of MODEL {model} to return or raise" if model else "the model's code to return or raise",
        found=site or f"SystemExit({e.code!r}) from the model's code",
        hint=_EXIT_HINT,
    )


def _exception_text(e: BaseException) -> str:
    message = str(e)
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


def _raise_site(e: BaseException, user_file: str | None) -> str | None:
    """``model.py, line 12: x = nn.Linear(3, -1)``: the deepest traceback frame in the user's file.

    With no ``user_file`` (a package module), the deepest frame outside importlib and this file is used.
    """
    frames = traceback.extract_tb(e.__traceback__)
    if user_file is not None:
        wanted = os.path.normcase(os.path.realpath(user_file))
        frames = [f for f in frames if os.path.normcase(os.path.realpath(f.filename)) == wanted]
    else:
        frames = [
            f
            for f in frames
            if not f.filename.startswith("<") and "importlib" not in f.filename and f.filename != __file__
        ]
    if not frames:
        return None
    frame = frames[-1]
    text = f"{Path(frame.filename).name}, line {frame.lineno}"
    return f"{text}: {frame.line.strip()}" if frame.line else text


def _find_attribute(
    module: types.ModuleType, attribute: str | None, *, where: str, user_file: Path | None
) -> tuple[str, Any]:
    """The ``(name, object)`` to build the model from: ``attribute`` if given, else the first default name."""
    candidates = _model_candidates(module)
    if attribute is None:
        for name in DEFAULT_MODEL_NAMES:
            if name in vars(module):
                return name, vars(module)[name]
        hint = "define build_model() returning the model, or pass MODEL as file.py:name"
        modules = [n for n in candidates if isinstance(vars(module)[n], type)]
        if len(modules) == 1:
            file_name = user_file.name if user_file else where
            hint = f"pass {file_name}:{modules[0]} to build it with no arguments, or {hint}"
        raise ModelLoadError(
            f"no model found in {where}",
            expected=f"one of {', '.join(DEFAULT_MODEL_NAMES)} (looked for in that order)",
            found=f"defined in {where}: {', '.join(candidates)}" if candidates else f"nothing usable in {where}",
            hint=hint,
        )
    obj: Any = module
    walked: list[str] = []
    for part in attribute.split("."):
        walked.append(part)
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            choices = candidates if len(walked) == 1 else _public_names(obj)
            close = difflib.get_close_matches(part, choices or _public_names(obj), n=1)
            raise ModelLoadError(
                f"{'.'.join(walked)!r} not found in {where}",
                expected="the name of a callable returning an nn.Module, or of an nn.Module",
                found=f"no attribute {part!r}",
                choices=choices or None,
                hint=f"did you mean {close[0]!r}?" if close else None,
            ) from e
    return attribute, obj


def _model_candidates(module: types.ModuleType) -> list[str]:
    """Public callables defined in the module itself, and nn.Module instances/classes at module level."""
    names = []
    for name, value in vars(module).items():
        if name.startswith("_") or name in _ROLE_NAMES:
            continue
        if isinstance(value, nn.Module):
            names.append(name)
        elif isinstance(value, type) and issubclass(value, nn.Module):
            names.append(name)
        elif inspect.isfunction(value) and value.__module__ == module.__name__:
            names.append(name)
    return names


def _public_names(obj: Any) -> list[str]:
    return sorted(n for n in dir(obj) if not n.startswith("_"))


def _instantiate(obj: Any, name: str, *, where: str, user_file: str | None) -> nn.Module:
    if isinstance(obj, nn.Module):
        return obj
    if not callable(obj):
        raise ModelLoadError(
            f"{name!r} in {where} is not a model",
            expected="an nn.Module instance, or a callable (factory or nn.Module class) returning one",
            found=f"{name} is {_type_name(obj)}",
        )
    required = _required_parameters(obj)
    if required:
        raise ModelLoadError(
            f"{name}() in {where} needs arguments, but MODEL is built with none",
            expected=f"{name} callable with no arguments",
            found=f"required parameters: {', '.join(required)}",
            hint=f"add e.g. `def build_model(): return {name}(...)` with your arguments to {where}, "
            "or give the parameters defaults",
        )
    try:
        result = obj()
    except (Exception, SystemExit) as e:
        raise ModelLoadError(
            f"calling {name}() from {where} raised {_exception_text(e)}"
            + (f": it called sys.exit({e.code!r})" if isinstance(e, SystemExit) else ""),
            expected=f"{name}() to return an nn.Module",
            found=_raise_site(e, user_file) or f"{type(e).__name__} in {name}()",
            hint=_EXIT_HINT if isinstance(e, SystemExit) else None,
        ) from e
    if not isinstance(result, nn.Module):
        raise ModelLoadError(
            f"{name}() in {where} did not return an nn.Module",
            expected="an instance of torch.nn.Module",
            found=f"{_type_name(result)}",
            hint="return the model itself (not a tuple, a state_dict or a Lightning/Trainer wrapper)",
        )
    return result


def check_trainable(model: nn.Module, source: ModelSource) -> None:
    """Raise :class:`~precision_audit.errors.ModelLoadError` unless ``model`` has a parameter that requires grad.

    The audit measures gradients (and the loss scale FP16 needs) through a backward pass; without a trainable
    parameter that backward has nothing to reach, and torch would fail deep inside the run with "element 0 of
    tensors does not require grad". :func:`load_model` itself accepts such modules (they load fine); the
    audit calls this right after it.

    Example::

        model, source = load_model("model.py")
        check_trainable(model, source)     # ModelLoadError for nn.ReLU(), or a fully frozen model
    """
    name, where = source.attribute, source.where
    params = list(model.parameters())
    _check_not_meta(model, name, where)
    if not params:
        raise ModelLoadError(
            f"the model built by {name} in {where} ({type(model).__name__}) has no parameters, "
            "so there is no training step to audit",
            expected="an nn.Module holding trainable parameters (nn.Linear, nn.Conv2d, nn.Embedding, ...)",
            found=f"{type(model).__name__} with 0 parameters",
            hint="pass the model that owns the weights; a parameter-free function needs no precision policy",
        )
    if not any(p.requires_grad for p in params):
        count = sum(p.numel() for p in params)
        raise ModelLoadError(
            f"none of the parameters of the model built by {name} in {where} requires grad, "
            "so the audit cannot take the backward pass it measures",
            expected="at least one parameter with requires_grad=True",
            found=f"{type(model).__name__}: {len(params)} parameter tensors ({count:,} values), all frozen",
            hint="unfreeze the layers you train (p.requires_grad_(True)) before returning the model",
        )


def _check_not_meta(model: nn.Module, name: str, where: str) -> None:
    """A model built on the ``meta`` device has shapes but no values: nothing can run or be measured."""
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    meta = [n for n, t in tensors if t.is_meta]
    if not meta:
        return
    raise ModelLoadError(
        f"the model built by {name} in {where} ({type(model).__name__}) is on the meta device: its parameters "
        "have shapes but no values, so there is nothing to run or measure",
        expected="a model whose parameters and buffers hold values, built on the CPU (the audit moves it to "
        "--device itself); meta-device models are not supported",
        found=f"{len(meta)} of {len(tensors)} parameter/buffer tensors on meta: {', '.join(meta[:5])}"
        + (", ..." if len(meta) > 5 else ""),
        hint="build the model on the CPU (drop device='meta' / `with torch.device('meta')`), or materialize it "
        "inside build_model: model.to_empty(device='cpu'), then initialize every weight (e.g. call your "
        "init_weights(), or each module's reset_parameters()) before returning it",
    )


def _required_parameters(fn: Callable[..., Any]) -> list[str]:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and C extensions: just call it
        return []
    kinds = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )
    return [p.name for p in signature.parameters.values() if p.kind in kinds and p.default is p.empty]


def _type_name(obj: Any) -> str:
    cls = type(obj)
    if cls.__module__ == "builtins":
        return f"a {cls.__qualname__}"
    return f"a {cls.__module__}.{cls.__qualname__}"


# ---------------------------------------------------------------------------------------------------------------
# Batch
# ---------------------------------------------------------------------------------------------------------------


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
            yield from _named_tensors(value, f"args[{i}]")
        for key, value in self.kwargs.items():
            yield from _named_tensors(value, key)
        if self.target is not None:
            yield from _named_tensors(self.target, "target")

    def describe(self) -> list[dict[str, Any]]:
        """Name, shape and dtype of every tensor (inputs, keyword inputs and target), for reports and JSON."""
        return [
            {"name": name, "shape": list(t.shape), "dtype": _dtype_name(t.dtype)} for name, t in self.tensors()
        ]

    def to(self, device: torch.device | str) -> Batch:
        """A copy with every tensor moved to ``device`` (``args``, ``kwargs``, ``target`` and ``raw`` alike).

        A tensor shared between ``raw`` and ``args`` is moved once and stays shared.
        """
        memo: dict[int, torch.Tensor] = {}
        return Batch(
            args=tuple(_map_tensors(a, device, memo) for a in self.args),
            kwargs={k: _map_tensors(v, device, memo) for k, v in self.kwargs.items()},
            target=_map_tensors(self.target, device, memo),
            raw=_map_tensors(self.raw, device, memo),
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
            found=f"sample_batch is {_type_name(fn)}",
        )
    try:
        raw = fn()
    except Exception as e:
        user_file = str(source.path) if source.path is not None else getattr(source.module, "__file__", None)
        raise BatchError(
            f"{label} raised {_exception_text(e)}",
            expected="sample_batch() to return a tensor, a tuple/list or a dict of tensors",
            found=_raise_site(e, user_file) or f"{type(e).__name__} in sample_batch()",
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
            found=_type_name(raw),
        )

    notes: tuple[str, ...] = ()
    if _takes_use_cache(model, len(args)) and "use_cache" not in kwargs:
        # A training step never reads the key/value cache, and the cache is updated in place by every call:
        # the audit's per-module re-runs would then attend over keys appended twice (T5 decoder attention
        # even changes its output structure). Hugging Face does the same under gradient checkpointing.
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


def _named_tensors(value: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _named_tensors(item, f"{name}[{key!r}]")
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _named_tensors(item, f"{name}[{i}]")


def _map_tensors(value: Any, device: torch.device | str, memo: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = value.to(device)
        return memo[id(value)]
    if isinstance(value, Mapping):
        items = {k: _map_tensors(v, device, memo) for k, v in value.items()}
        try:
            return type(value)(items)
        except TypeError:  # a Mapping that cannot be built from a dict
            return items
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_map_tensors(v, device, memo) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, device, memo) for v in value)
    return value


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------------------------


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
        return self._compute(output, batch).float().reshape(())


def resolve_loss(source: ModelSource, output: Any, batch: Batch) -> LossSpec:
    """Choose the loss for ``output`` (one FP32 forward of ``batch``), in this order.

    1. ``loss_fn(output, batch)`` defined in the model file (called with ``batch.raw``);
    2. ``output.loss`` / ``output["loss"]``, a scalar floating tensor (Hugging Face models given labels);
    3. with a target: cross-entropy for an integer target matching the logits ([N, C] / [N], [N, C, d...] /
       [N, d...], or [..., C] / [...]); MSE for a floating target of the output's shape;
    4. a surrogate, mean of <y, r> over every floating output tensor y, with r fixed (standard normal,
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

    spec = _surrogate(output, reason, source)
    logger.info("loss: %s", spec.description)
    return spec


def _user_loss(source: ModelSource, fn: Any, output: Any, batch: Batch) -> LossSpec:
    where = source.where
    if not callable(fn):
        raise LossError(
            f"loss_fn in {where} is not callable",
            expected="def loss_fn(output, batch): return <scalar tensor>",
            found=f"loss_fn is {_type_name(fn)}",
        )
    try:
        value = fn(output, batch.raw)
    except Exception as e:
        user_file = str(source.path) if source.path is not None else getattr(source.module, "__file__", None)
        raise LossError(
            f"loss_fn(output, batch) in {where} raised {_exception_text(e)}",
            expected="loss_fn(output, batch) to return a scalar floating tensor",
            found=_raise_site(e, user_file) or f"{type(e).__name__} in loss_fn",
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
        found = f"a {_dtype_name(value.dtype)} tensor of shape {list(value.shape)}"
    else:
        found = _type_name(value)
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
    target_text = f"the {_dtype_name(target.dtype)} target of shape {list(target.shape)}"
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
            classes = " or ".join(str(c) for _, c in layouts)
            return None, f"{target_text} has class indices {low}..{high}, outside the {classes} classes of {where}"
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
        target = batch.target
        if self.layout == "last":
            return F.cross_entropy(y.reshape(-1, y.shape[-1]), target.reshape(-1))
        return F.cross_entropy(y, target)


class _MSE:
    def __call__(self, output: Any, batch: Batch) -> torch.Tensor:
        return F.mse_loss(_require_primary(output), batch.target)


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
    leaves = [(name, t) for name, t in _floating_leaves(output, "output") if t.numel() > 0]
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
        leaves = [t for _, t in _floating_leaves(output, "output") if t.numel() > 0]
        if not leaves:
            raise LossError(
                "the model's output contains no floating-point tensor",
                expected="the same structure as the first forward",
                found=output_structure(output),
            )
        total = None
        for y in leaves:
            r = self.direction(tuple(y.shape), y.device)
            term = (y.float() * r).sum() / y.numel()
            total = term if total is None else total + term
        return total


def _floating_leaves(value: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield name, value
    elif isinstance(value, Mapping):  # dicts and Hugging Face ModelOutput
        for key, item in value.items():
            yield from _floating_leaves(item, f"{name}[{key!r}]")
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _floating_leaves(item, f"{name}[{i}]")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _floating_leaves(getattr(value, f.name), f"{name}.{f.name}")


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
