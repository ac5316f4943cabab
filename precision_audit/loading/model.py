"""MODEL: a ``.py`` file or an importable ``package.module:name``, turned into an ``nn.Module``.

A file defines ``build_model()``, ``get_model()`` or a module-level ``model`` (looked for in that order;
``model.py:name`` picks another callable or attribute). It may also define ``loss_fn(output, batch)``
(:mod:`.loss`) and ``sample_batch()`` (:mod:`.batch`), read from :attr:`ModelSource.module`.

Example::

    model, source = load_model("model.py:make_big")
    check_trainable(model, source)
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import logging
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from precision_audit.errors import ModelLoadError

from .failures import EXIT_HINT, exception_text, import_failure, raise_site, syntax_failure, type_name

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODEL_NAMES", "ModelSource", "check_trainable", "load_model"]

#: Names looked for in a model file, in this order, when MODEL has no ``:name`` suffix.
DEFAULT_MODEL_NAMES: tuple[str, ...] = ("build_model", "get_model", "model")

#: Optional hooks a model file may define; never offered as the model itself.
_ROLE_NAMES: frozenset[str] = frozenset({"loss_fn", "sample_batch"})

_MODULE_PREFIX = "_precision_audit_user_model_"


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
            raise import_failure(e, where=module_name, user_file=None) from e
        except SyntaxError as e:
            raise syntax_failure(e, where=module_name) from e
        except (Exception, SystemExit) as e:
            raise import_failure(e, where=module_name, user_file=None) from e
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
        raise syntax_failure(e, where=path.name) from e
    except (Exception, SystemExit) as e:
        del sys.modules[module_name]
        raise import_failure(e, where=path.name, user_file=str(path)) from e
    logger.debug("imported %s as module %s", path, module_name)
    return module


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
            found=f"{name} is {type_name(obj)}",
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
            f"calling {name}() from {where} raised {exception_text(e)}"
            + (f": it called sys.exit({e.code!r})" if isinstance(e, SystemExit) else ""),
            expected=f"{name}() to return an nn.Module",
            found=raise_site(e, user_file) or f"{type(e).__name__} in {name}()",
            hint=EXIT_HINT if isinstance(e, SystemExit) else None,
        ) from e
    if not isinstance(result, nn.Module):
        raise ModelLoadError(
            f"{name}() in {where} did not return an nn.Module",
            expected="an instance of torch.nn.Module",
            found=f"{type_name(result)}",
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
    _check_float32_trainables(model, name, where)
    if not any(p.requires_grad for p in params):
        count = sum(p.numel() for p in params)
        raise ModelLoadError(
            f"none of the parameters of the model built by {name} in {where} requires grad, "
            "so the audit cannot take the backward pass it measures",
            expected="at least one parameter with requires_grad=True",
            found=f"{type(model).__name__}: {len(params)} parameter tensors ({count:,} values), all frozen",
            hint="unfreeze the layers you train (p.requires_grad_(True)) before returning the model",
        )


def _check_float32_trainables(model: nn.Module, name: str, where: str) -> None:
    """The audit measures each format against an FP32 pass of the same model. A model whose trained parameters
    are all fp16/bf16 (``model.half()``, ``.to(torch.bfloat16)``) has no FP32 pass: its "reference" would be its
    own low-precision run, and the format it is already in would show no error at all. A model that trains
    float64 parameters and no float32 ones is refused too: autocast casts float32 tensors only, so an fp16/bf16
    policy would change nothing in it, and the audit's estimates of its speed-up would be false. Frozen
    low-precision parameters beside float32 trained ones (a frozen bf16 base under float32 adapters) are the model
    as trained, and are accepted."""
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.is_floating_point()]
    if not trained or any(p.dtype == torch.float32 for _, p in trained):
        return
    dtypes = sorted({str(p.dtype).replace("torch.", "") for _, p in trained})
    found = (f"{len(trained)} trained parameter tensors, all {'/'.join(dtypes)}, e.g. "
             + ", ".join(n for n, _ in trained[:3]))
    if any(p.dtype == torch.float64 for _, p in trained):
        # autocast casts float32 tensors only: its eligibility test leaves float64 ones alone (docs/report.md)
        raise ModelLoadError(
            f"the model built by {name} in {where} ({type(model).__name__}) trains {', '.join(dtypes)} parameters "
            "and no float32 ones; autocast leaves float64 tensors in float64 (it casts float32 ones only), so an "
            "fp16/bf16 policy would change neither this model's numbers nor its speed",
            expected="float32 parameters, as a mixed-precision run keeps them (autocast computes in fp16/bf16 from "
            "float32 weights)",
            found=found,
            hint="build the model in float32 (drop the .double() / dtype=torch.float64 in the model file, and give "
            "it float32 inputs); the audit then says whether bf16 or fp16 is safe for it",
        )
    raise ModelLoadError(
        f"the model built by {name} in {where} ({type(model).__name__}) trains {', '.join(dtypes)} parameters "
        "only, so there is no FP32 pass to measure low precision against (the format it is in would show no "
        "error at all)",
        expected="float32 parameters, as a mixed-precision run keeps them (autocast computes in fp16/bf16 from "
        "float32 weights)",
        found=found,
        hint="build the model in float32 (drop the .half() / .to(torch.bfloat16) in the model file); the audit then "
        "says whether bf16 or fp16 is safe for it",
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
