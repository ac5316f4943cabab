"""torchao ``Float8Linear`` modules that train under autocast (docs/fp8.md, "Runtime").

A recipe that keeps a GEMM in high precision (a cast config with ``ScalingType.DISABLED``: torchao's
``rowwise_with_gw_hp`` keeps the weight-gradient GEMM's operands unscaled) hands that GEMM its operands as they
are; under autocast one of them is in the autocast dtype and the other in FP32, and ``torch.mm`` refuses the pair
in the backward. That happens under an autocast torchao does not read: torchao 0.18's ``Float8Linear.forward``
casts its input to the autocast dtype only under CUDA's autocast (its code: "for now, hardcode to GPU's autocast
dtype"), and then every high-precision pair agrees (BF16 x BF16); under CPU autocast (the audit's emulation of
CUDA autocast, a CPU user's loop) the input stays FP32 while autocast makes the output gradient BF16. Such a module
becomes :class:`AutocastSafeFloat8Linear` (its class swapped, its parameters, config and hooks kept): under an
autocast torchao does not read, it runs with autocast off on its input rounded to the autocast dtype and held as
FP32 values, and rounds its output to the autocast dtype, as torchao returns under CUDA autocast; on CUDA, and
outside autocast, it is torchao's module, bit for bit (so on a GPU its high-precision GEMM stays BF16, as
fp8/cost.py prices it). A class, not an instance ``forward``: the converted model deep-copies
(a copied closure would call the original module), pickles and prints as one.

This module imports only torch and torchao (torchao is the optional extra ``precision-audit[fp8]``, so the
package imports it only when it converts a module): ``export --to torchao`` copies the code below the imports
into the Python it generates (precision_audit/fp8/export.py), so the users' code is this code.
"""

from __future__ import annotations

import dataclasses

import torch
from torchao.float8.config import CastConfig, ScalingType
from torchao.float8.float8_linear import Float8Linear

#: the device types whose autocast torchao's Float8Linear reads itself (it casts its input to the autocast dtype)
TORCHAO_READS_AUTOCAST = frozenset({"cuda"})


class AutocastSafeFloat8Linear(Float8Linear):
    """torchao's Float8Linear for a recipe that keeps a GEMM in high precision: under an autocast torchao does not
    read (not CUDA's), the module runs with autocast off on its input rounded to the autocast dtype and held as FP32
    values, and returns the autocast dtype; otherwise torchao's forward unchanged."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        device_type = self.weight.device.type
        if device_type in TORCHAO_READS_AUTOCAST or not (
                torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)):
            return super().forward(input)
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            return super().forward(input.to(dtype).float()).to(dtype)


def keeps_a_gemm_in_high_precision(config) -> bool:
    """Whether a ``Float8LinearConfig`` leaves some GEMM operand unscaled (``ScalingType.DISABLED``): such a module
    needs :class:`AutocastSafeFloat8Linear` to train under autocast."""
    return any(isinstance(v, CastConfig) and v.scaling_type is ScalingType.DISABLED
               for v in (getattr(config, f.name) for f in dataclasses.fields(config)))


def make_autocast_safe(model: torch.nn.Module, names) -> list[str]:
    """Swap the class of the torchao ``Float8Linear`` modules of ``model`` named in ``names`` to
    :class:`AutocastSafeFloat8Linear`, in place; returns the names found (a module swapped before, or of another
    ``Float8Linear`` subclass, is left as it is)."""
    wanted = frozenset(names)
    done = []
    for name, mod in model.named_modules(remove_duplicate=False):
        if name in wanted and isinstance(mod, Float8Linear):
            if type(mod) is Float8Linear:
                mod.__class__ = AutocastSafeFloat8Linear
            done.append(name)
    return sorted(done)
