"""CUDA autocast's numerics on a CPU (docs/emulation.md): what emulated mode runs instead of a GPU.

One subject, below the capture that uses it: this package imports only torch, errors.py and options.py (the
``--kernels`` choices), and nothing of capture/, which runs its passes under it. The face is what the passes,
``precision-audit verify`` and the command line use; the modules behind it are:

- ``autocast.py``: :class:`CudaAutocastPolicy` (CPU autocast re-registered with CUDA's cast policy) and
  :func:`emulated_autocast`; the gaps every emulated audit states (:data:`KNOWN_GAPS`);
- ``autocast_policy.py``: CUDA autocast's cast policy per op (:data:`CUDA_POLICY`) and the check of this
  torch's registrations against it;
- ``gemm_mode.py``: :class:`LowPrecisionGemmMode` (Tensor Core GEMMs: low-precision inputs, fp32 accumulation)
  and :class:`Tf32GemmMode`;
- ``modelled_ops.py``, ``cuda_kernels.py``: the kernels that round more than once, step by step;
- ``rounding.py``: rounding to a dtype, and the registry of the rounded copies autograd saves (docs/memory.md);
- ``compiled.py`` and ``_emulation_kernels.cpp``: the same kernels and the fused statistics in C++, built on
  request (``precision-audit build-kernels``; docs/emulation.md, "Compiled kernels").

Example::

    from precision_audit.emulation import CudaAutocastPolicy, emulated_autocast
    with CudaAutocastPolicy(), emulated_autocast(torch.float16):
        y = model(x)          # CUDA autocast's dtypes and roundings, on the CPU
"""

from . import compiled
from .autocast import KNOWN_GAPS, CudaAutocastPolicy, emulated_autocast
from .autocast_policy import (
    CUDA_POLICY,
    CastPolicy,
    check_registrations,
    installed_policy,
    registered_cuda_autocast_ops,
)
from .compiled import resolve as resolve_kernels
from .gemm_mode import (
    TF32_EMULATION,
    LowPrecisionGemmMode,
    Tf32GemmMode,
    is_missing_low_precision_kernel,
    round_to_tf32,
)
from .rounding import (
    drained_registry,
    rounded_info,
    rounding_registry_paused,
    start_rounding_registry,
    stop_rounding_registry,
)

__all__ = [
    # emulated autocast
    "CudaAutocastPolicy", "KNOWN_GAPS", "emulated_autocast",
    # CUDA's cast policy
    "CUDA_POLICY", "CastPolicy", "check_registrations", "installed_policy", "registered_cuda_autocast_ops",
    # GEMMs as Tensor Cores compute them
    "LowPrecisionGemmMode", "TF32_EMULATION", "Tf32GemmMode", "is_missing_low_precision_kernel", "round_to_tf32",
    # the rounded copies autograd saves (capture/memory.py, distributed/saved.py)
    "drained_registry", "rounded_info", "rounding_registry_paused", "start_rounding_registry",
    "stop_rounding_registry",
    # the compiled kernels (build, load, the fused statistics' ops)
    "compiled", "resolve_kernels",
]
