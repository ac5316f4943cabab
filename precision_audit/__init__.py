"""precision-audit: measure where FP16/BF16 mixed precision loses accuracy in a PyTorch model.

Example::

    import precision_audit
    result = precision_audit.audit(model, (x, y))          # live objects (README.md, "From Python")
    print(result.summary())

    from precision_audit import AuditOptions, run_audit
    result = run_audit(AuditOptions(model="model.py", batch="sample.pt"))   # files, as the command line

    policy = precision_audit.load_policy("audit/policy.json")              # in training (docs/policy.md)
    handle = precision_audit.apply_policy(model, policy)
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

from .errors import AuditError  # (no torch: `import precision_audit` stays light)
from .version import __version__

if TYPE_CHECKING:
    from .audit import AuditResult

#: Imported on first use: importing torch takes seconds, and the command line must have its Ctrl-C handling in
#: place before that (README.md, "Exit codes").
#: ``audit`` is the module precision_audit/audit.py itself, which is callable: ``precision_audit.audit(model,
#: batch)`` runs precision_audit/api.py's audit().
_LAZY = {"audit": ".audit", "AuditOptions": ".audit", "run_audit": ".audit", "AuditResult": ".audit",
         "Format": ".formats", "load_policy": ".policy.io", "Policy": ".policy.schema",
         # The runtime's functions (docs/policy.md, "The runtime"); the Policy record itself is data only.
         "apply_policy": ".runtime.api", "autocast": ".runtime.api", "grad_scaler": ".runtime.api",
         "controller": ".runtime.api", "shard_fsdp2": ".runtime.api"}


class _AuditModule(types.ModuleType):
    """The class of the module ``precision_audit.audit`` (precision_audit/audit.py sets it as it loads): called,
    the module is the live-object audit, ``precision_audit.audit(model, batch, ...)`` runs
    :func:`precision_audit.api.audit`. (A plain function of that name in the package would be replaced by the
    module as soon as it is imported, and ``import precision_audit.audit`` must keep working.) It lives here, in
    the package's front door, so that audit.py never imports api.py, which imports audit.py (docs/architecture.md:
    no import cycle)."""

    def __call__(self, model: Any, batch: Any, **kwargs: Any) -> AuditResult:
        from .api import audit

        return audit(model, batch, **kwargs)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        from .errors import check_torch_version

        check_torch_version()  # a clear message on an old torch, not an AttributeError deep in a pass

        module = importlib.import_module(_LAZY[name], __name__)
        return module if name == "audit" else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AuditError", "AuditOptions", "AuditResult", "Format", "Policy", "apply_policy", "audit", "autocast",
           "controller", "grad_scaler", "load_policy", "run_audit", "shard_fsdp2", "__version__"]
