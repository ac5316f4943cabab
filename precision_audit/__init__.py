"""precision-audit: measure where FP16/BF16 mixed precision loses accuracy in a PyTorch model.

Example::

    from precision_audit import AuditOptions, run_audit
    result = run_audit(AuditOptions(model="model.py", batch="sample.pt"))
"""

__version__ = "0.1.0"

from .errors import AuditError  # noqa: E402
from .formats import Format  # noqa: E402
from .policy.io import load_policy  # noqa: E402
from .policy.schema import Policy  # noqa: E402


def __getattr__(name: str):
    # The audit machinery loads lazily: `import precision_audit` in a training script stays light.
    if name in ("AuditOptions", "run_audit", "AuditResult"):
        from . import audit

        return getattr(audit, name)
    raise AttributeError(name)


__all__ = ["AuditError", "AuditOptions", "AuditResult", "Format", "Policy", "load_policy", "run_audit", "__version__"]
