"""Turn the user's MODEL and BATCH arguments into an ``nn.Module``, a :class:`Batch` and a loss.

MODEL is a path to a ``.py`` file that defines ``build_model()``, ``get_model()`` or a module-level ``model``
(looked for in that order; ``model.py:name`` picks another callable or attribute), or an importable
``package.module:name``. The file may also define ``loss_fn(output, batch)`` and ``sample_batch()``.

BATCH is a file written by ``torch.save``: a tensor, a tuple/list (``inputs...`` or ``(inputs, target)``), or a
dict of keyword arguments. It is always loaded with ``weights_only=True``: precision-audit never unpickles
arbitrary code.

The loss used for gradients is resolved in a fixed order: the file's ``loss_fn`` -> the model's own
``output.loss`` -> cross-entropy or MSE inferred from the batch's target -> a deterministic surrogate.

The package, in the order the audit uses it:

- :mod:`.model` -- MODEL -> ``nn.Module`` and :class:`ModelSource` (``load_model``, ``check_trainable``);
- :mod:`.batch` -- BATCH -> :class:`Batch`, split with the forward's signature (``load_batch``);
- :mod:`.loss` -- one FP32 output -> :class:`LossSpec` (``resolve_loss``);
- :mod:`.failures` -- how an exception or ``sys.exit()`` in the user's code is told (``model_exit_error``);
- :mod:`.nested` -- walking tensors in nested outputs and batches (``output_structure``).

Example::

    model, source = load_model("model.py")
    batch = load_batch("sample.pt", model, source)
    output = model(*batch.args, **batch.kwargs)
    loss_spec = resolve_loss(source, output, batch)
    loss = loss_spec(output, batch)          # float32 scalar
"""

from __future__ import annotations

from .batch import Batch, load_batch
from .failures import model_exit_error
from .loss import LossKind, LossSpec, resolve_loss
from .model import DEFAULT_MODEL_NAMES, ModelSource, check_trainable, load_model
from .nested import output_structure

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

# Not public, but precision_audit.api uses it: a batch the caller holds in memory is split the way load_batch
# splits a file.
from .batch import _interpret as _interpret
