"""torch.compile'd code runs eagerly while the session is open, without importing Dynamo where nothing is compiled.

The session's hooks and statistics must see a compiled submodule's ops one by one, so its passes run under
``torch.compiler.set_stance("force_eager")`` (docs/gpu.md). Setting a stance imports ``torch._dynamo``, which
costs 1-3 s of a process's first audit (bench/README.md, "Issue 33"): on a small model, more than the model's
own passes. Nothing can have been compiled in a process that has not imported ``torch._dynamo`` (torch.compile
imports it), so :func:`force_eager` sets the stance at once when Dynamo is loaded, and otherwise waits for it:
should the model import Dynamo during the session (a ``torch.compile`` called inside its forward), the stance is
set as soon as that import finishes, before anything it compiles can run. The stance is put back when the
session closes, either way.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator
from typing import Any

import torch

DYNAMO = "torch._dynamo"


@contextlib.contextmanager
def force_eager() -> Iterator[None]:
    """While entered, torch.compile'd functions and modules run their eager code (module docstring)."""
    with contextlib.ExitStack() as stack:
        if DYNAMO in sys.modules:
            stack.enter_context(torch.compiler.set_stance("force_eager"))
            yield
            return
        watcher = _WhenDynamoLoads(lambda: stack.enter_context(torch.compiler.set_stance("force_eager")))
        sys.meta_path.insert(0, watcher)
        try:
            yield
        finally:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(watcher)


class _WhenDynamoLoads(importlib.abc.MetaPathFinder):
    """A finder that lets the other finders find ``torch._dynamo`` and runs ``then`` once its import finishes."""

    def __init__(self, then: Any) -> None:
        self.then = then
        self.busy = False

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != DYNAMO or self.busy:
            return None
        self.busy = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self.busy = False
        if spec.loader is not None:
            spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    """The finder's loader, running ``then`` after the module's code (and giving the module its own loader back)."""

    def __init__(self, inner: Any, then: Any) -> None:
        self.inner = inner
        self.then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self.inner
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        self.inner.exec_module(module)
        self.then()
