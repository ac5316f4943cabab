"""Which stored audit.json files this machine's arithmetic can reproduce exactly.

An audit's figures are sums of FP32 products: a GEMM, a convolution or an ``exp`` gives results that differ in
the last bits from one CPU to another (MKL and oneDNN pick their kernels by the instruction set, and so their
summation order), and rounding to fp16/bf16 turns some of those last-bit differences into different rounded
values and different counts. Measured: the files made on the machine of 2026-11-23 and a run on an AVX-512 +
AMX Xeon of 2026-11-27 differ by up to 2e-5 relative in error figures and by a few elements in one subnormal
count (tests/golden/README.md). So the stored files come in variants, one per kind of arithmetic, and the
comparison picks the variant whose *probe* — a digest of the bits of the FP32 operations the sample models
run, at the audit's two thread counts — matches this machine's.

``variant_dir()`` is the folder to compare against, or None when no stored variant has this machine's probe (the
original files, made before variants existed, are then the only candidate: see ``stored_file``).
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = HERE / "variants.json"  # probe digest -> variant folder name


@functools.cache
def probe() -> str:
    """A digest of the exact bits of FP32 GEMMs, convolutions and transcendental functions of the samples' shapes,
    computed at the audit's thread counts (the default, and 1)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1234)
    h = hashlib.sha256()
    saved = torch.get_num_threads()
    try:
        for threads in sorted({saved, 1, 2}):
            torch.set_num_threads(threads)
            for m, k, n in ((32, 64, 128), (32, 128, 128), (32, 128, 16), (64, 32, 96), (4, 8, 8), (256, 64, 64)):
                a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
                h.update((a @ b).numpy().tobytes())
                h.update(torch.addmm(torch.randn(n, generator=g), a, b).numpy().tobytes())
                h.update((a.half().float() @ b.half().float()).half().numpy().tobytes())
            x = torch.randn(8, 16, 16, 16, generator=g)
            h.update(F.conv2d(x, torch.randn(32, 16, 3, 3, generator=g), torch.randn(32, generator=g),
                              padding=1).numpy().tobytes())
            q = torch.randn(2, 4, 16, 8, generator=g)
            h.update(F.scaled_dot_product_attention(q, q * 0.5, q * 2, is_causal=True).numpy().tobytes())
            v = torch.randn(4096, generator=g) * 4
            fns = (torch.exp, torch.tanh, torch.erf, F.gelu, F.silu, torch.sigmoid, torch.relu, torch.rsqrt)
            for dtype in (torch.float32, torch.float16, torch.bfloat16):  # fp16/bf16: the CPU's native kernels
                for f in fns:
                    x = v.to(dtype).clone().requires_grad_()
                    y = f(x)
                    y.backward(torch.ones_like(y))
                    assert x.grad is not None
                    h.update(y.detach().float().numpy().tobytes())
                    h.update(x.grad.float().numpy().tobytes())
                h.update(F.softmax(v.to(dtype).view(64, 64), -1).float().numpy().tobytes())
            h.update(F.softmax(v.view(64, 64), -1).numpy().tobytes())
            h.update(F.layer_norm(v.view(64, 64), (64,)).numpy().tobytes())
    finally:
        torch.set_num_threads(saved)
    return h.hexdigest()[:16]


def variants() -> dict[str, str]:
    return json.loads(VARIANTS.read_text()) if VARIANTS.exists() else {}


def variant_dir() -> Path | None:
    name = variants().get(probe())
    return None if name is None else HERE / name


def stored_file(name: str) -> tuple[Path, bool]:
    """(the stored audit.json of sample ``name`` to compare against, whether this machine's probe is known for
    it). Unknown: the original files (tests/golden/<name>.audit.json), which a machine of another arithmetic
    cannot reproduce exactly."""
    d = variant_dir()
    if d is not None and (d / f"{name}.audit.json").exists():
        return d / f"{name}.audit.json", True
    return HERE / f"{name}.audit.json", False
