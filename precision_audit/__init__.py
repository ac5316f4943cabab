"""precision-audit: measure where FP16/BF16 mixed precision loses accuracy in a PyTorch model.

Example::

    from precision_audit import AuditOptions, run_audit
    result = run_audit(AuditOptions(model="model.py", batch="sample.pt"))
"""

__version__ = "0.1.0"

from .errors import AuditError  # noqa: E402  (no torch: `import precision_audit` stays light)

#: Imported on first use: importing torch takes seconds, and the command line must have its Ctrl-C handling in
#: place before that (README.md, "Exit codes").
_LAZY = {"AuditOptions": ".audit", "run_audit": ".audit", "AuditResult": ".audit", "Format": ".formats",
         "load_policy": ".policy.io", "Policy": ".policy.schema"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AuditError", "AuditOptions", "AuditResult", "Format", "Policy", "load_policy", "run_audit", "__version__"]
