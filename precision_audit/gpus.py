"""The target GPUs: compute capability, SM count, memory, bandwidth and dense peak throughput.

Every figure carries a comment naming its source; docs/gpus.md collects the sources (peaks, memory, compute
capability, SM counts) and the conventions. Conventions:

- Tensor-core peaks are **dense** (no 2:4 structured sparsity) with **FP32 accumulate**. NVIDIA datasheets
  usually print tensor figures *with* sparsity (marked ``*``); the dense figure is half of that.
- ``"fp32"`` is the plain (non-tensor-core) FP32 rate; ``"tf32"`` is the tensor-core rate for FP32 GEMMs with
  TF32 enabled.
- ``None`` means the GPU has no tensor-core path for that format (V100 and T4: no BF16/TF32/FP8; Ampere: no FP8).
- GeForce cards run FP16/BF16 with FP32 accumulate at half their FP16-accumulate rate; the FP32-accumulate
  figure is the one kept here, because that is what ``torch.autocast`` GEMMs use.

Rows whose figures were not re-read from a primary source carry ``confidence="uncertain"``; the ``targets``
table shows that mark, so nobody mistakes a remembered number for a datasheet one.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import OptionError
from .formats import CANDIDATE_FORMATS, GPU_TABLE_FORMATS, names

__all__ = [
    "CANDIDATE_ORDER",
    "CONFIDENCE_LEVELS",
    "DEFAULT_TARGET_KEY",
    "FORMAT_NAMES",
    "GPUS",
    "GpuSpec",
    "format_targets_table",
    "get_gpu",
    "match_detected",
    "resolve_target",
    "supported_formats",
]

#: The format names used everywhere (CLI, JSON, peak tables).
FORMAT_NAMES: tuple[str, ...] = names(GPU_TABLE_FORMATS)

#: Order in which formats are offered to the planner, widest first (``fp8_e5m2`` is a backward-pass format
#: paired with ``fp8_e4m3``, so it is not a candidate of its own).
CANDIDATE_ORDER: tuple[str, ...] = names(CANDIDATE_FORMATS)

#: ``"cited"``: read from a (copy of a) datasheet or whitepaper table; ``"uncertain"``: at least one figure of
#: the row was not re-read from a primary source, or sources disagree (docs/gpus.md, "Conventions").
CONFIDENCE_LEVELS: tuple[str, ...] = ("cited", "uncertain")

# Minimum compute capability for a tensor-core path per format (docs/gpus.md, "Compute capability and format
# support"; torch: is_bf16_supported / is_tf32_supported are `major >= 8`, FP8 _scaled_mm needs SM >= 8.9).
_MIN_CC: Mapping[str, tuple[int, int]] = types.MappingProxyType(
    {
        "fp32": (0, 0),  # not a tensor-core format; always available
        "fp16": (7, 0),  # Volta
        "bf16": (8, 0),  # Ampere
        "tf32": (8, 0),  # Ampere
        "fp8_e4m3": (8, 9),  # Ada / Hopper
        "fp8_e5m2": (8, 9),
    }
)

DEFAULT_TARGET_KEY = "h100-sxm"


def _check_format(fmt: str) -> str:
    if fmt not in _MIN_CC:
        raise OptionError(
            f"unknown number format {fmt!r}",
            choices=FORMAT_NAMES,
            hint="use one of the format names above",
        )
    return fmt


def supported_formats(compute_capability: tuple[int, int]) -> tuple[str, ...]:
    """Formats with a tensor-core path (plus ``fp32``) on a GPU of this compute capability.

    The single rule used both for the target table and for detected GPUs: FP16 from CC 7.0, BF16 and TF32
    from 8.0, FP8 (E4M3 and E5M2) from 8.9.

    Example::

        >>> supported_formats((7, 5))
        ('fp32', 'fp16')
        >>> supported_formats((9, 0))
        ('fp32', 'tf32', 'fp16', 'bf16', 'fp8_e4m3', 'fp8_e5m2')
    """
    cc = (int(compute_capability[0]), int(compute_capability[1]))
    return tuple(fmt for fmt in FORMAT_NAMES if cc >= _MIN_CC[fmt])


def _peaks(**values: float | None) -> Mapping[str, float | None]:
    missing = set(FORMAT_NAMES) - set(values)
    extra = set(values) - set(FORMAT_NAMES)
    if missing or extra:  # a table-construction bug, not a user error
        raise ValueError(f"peak_tflops: missing {sorted(missing)}, unknown {sorted(extra)}")
    return types.MappingProxyType({fmt: values[fmt] for fmt in FORMAT_NAMES})


@dataclass(frozen=True)
class GpuSpec:
    """One row of the target table (dense peaks, FP32 accumulate; see the module docstring).

    Example::

        >>> h100 = resolve_target("h100")
        >>> h100.peak_tflops["bf16"], h100.supports("fp8_e4m3")
        (989.4, True)
    """

    name: str
    key: str
    aliases: tuple[str, ...]
    compute_capability: tuple[int, int]
    sms: int
    memory_gb: float
    bandwidth_gbps: float
    # Excluded from the hash (a mappingproxy is unhashable) but compared for equality.
    peak_tflops: Mapping[str, float | None] = field(hash=False)
    source: str
    confidence: str
    notes: str = ""
    _formats: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", self.key):
            raise ValueError(f"key: {self.key!r} is not lower-case words joined by dashes")
        if self.confidence not in CONFIDENCE_LEVELS:
            raise ValueError(f"confidence: {self.confidence!r} not in {CONFIDENCE_LEVELS}")
        if self.sms <= 0 or self.memory_gb <= 0 or self.bandwidth_gbps <= 0:
            raise ValueError(f"{self.key}: sms, memory_gb and bandwidth_gbps must be positive")
        if not isinstance(self.peak_tflops, types.MappingProxyType):
            object.__setattr__(self, "peak_tflops", _peaks(**dict(self.peak_tflops)))
        formats = supported_formats(self.compute_capability)
        object.__setattr__(self, "_formats", formats)
        # The peak table and the compute-capability rule must agree: a number exactly where there is support.
        for fmt in FORMAT_NAMES:
            value = self.peak_tflops[fmt]
            if (value is not None) != (fmt in formats):
                raise ValueError(
                    f"peak_tflops[{fmt!r}] of {self.key}: {value!r} disagrees with compute capability "
                    f"{self.compute_capability} (supported: {formats})"
                )
            if value is not None and value <= 0:
                raise ValueError(f"peak_tflops[{fmt!r}] of {self.key} must be positive, got {value}")

    @property
    def cc_string(self) -> str:
        """Compute capability as ``"9.0"``."""
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"

    def supports(self, fmt: str) -> bool:
        """Whether this GPU has a tensor-core path for ``fmt`` (``fp32`` is always supported).

        Example::

            >>> resolve_target("v100").supports("bf16")
            False
        """
        return _check_format(fmt) in self._formats

    def peak(self, fmt: str) -> float | None:
        """Dense peak in TFLOP/s for ``fmt``, or ``None`` where the format is unsupported.

        Example::

            >>> resolve_target("a100").peak("tf32")
            156.0
        """
        return self.peak_tflops[_check_format(fmt)]

    def candidate_formats(self) -> tuple[str, ...]:
        """Formats the planner may choose on this GPU, widest first.

        Example::

            >>> resolve_target("t4").candidate_formats()
            ('fp32', 'fp16')
        """
        return tuple(fmt for fmt in CANDIDATE_ORDER if fmt in self._formats)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (for ``audit.json``'s ``target``)."""
        return {
            "key": self.key,
            "name": self.name,
            "aliases": list(self.aliases),
            "compute_capability": list(self.compute_capability),
            "sms": self.sms,
            "memory_gb": self.memory_gb,
            "bandwidth_gbps": self.bandwidth_gbps,
            "peak_tflops": dict(self.peak_tflops),
            "peak_kind": "dense, fp32 accumulate",
            "supported_formats": list(self._formats),
            "source": self.source,
            "confidence": self.confidence,
            "notes": self.notes,
        }


# --------------------------------------------------------------------------------------------------------
# The table. Sources: the per-row citation below; docs/gpus.md collects them, with the SM counts.
# --------------------------------------------------------------------------------------------------------

GPUS: tuple[GpuSpec, ...] = (
    GpuSpec(
        name="H100 SXM",
        key="h100-sxm",
        aliases=("h100", "h100-sxm5", "h100-80gb-hbm3"),
        compute_capability=(9, 0),
        sms=132,  # docs/gpus.md, "SM counts"
        memory_gb=80.0,  # 80 GB HBM3: H100 datasheet
        bandwidth_gbps=3350.0,  # 3.35 TB/s: H100 datasheet
        peak_tflops=_peaks(
            fp32=67.0,  # 67 TFLOP/s FP32: H100 SXM datasheet
            tf32=494.7,  # 494.7 dense TF32: H100 SXM datasheet, 989 with sparsity
            fp16=989.4,  # 989.4 dense FP16: H100 SXM datasheet, 1,979 with sparsity
            bf16=989.4,  # 989.4 TFLOP/s dense BF16: H100 SXM datasheet, 1,979 with sparsity
            fp8_e4m3=1978.9,  # 1,978.9 dense FP8: H100 SXM datasheet, 3,958 with sparsity
            fp8_e5m2=1978.9,  # E5M2 runs at the E4M3 rate (same datasheet line "FP8")
        ),
        source="NVIDIA H100 datasheet ('*Shown with sparsity. Specifications 1/2 lower without sparsity'), "
        "via HPCtech copy; dense values cross-checked with glennklockwood.com",
        confidence="cited",
    ),
    GpuSpec(
        name="H100 PCIe",
        key="h100-pcie",
        aliases=("h100-pcie-80gb",),
        compute_capability=(9, 0),
        sms=114,  # docs/gpus.md, "SM counts"
        memory_gb=80.0,  # 80 GB HBM2e: H100 datasheet
        bandwidth_gbps=2000.0,  # 2.0 TB/s: H100 datasheet
        peak_tflops=_peaks(
            fp32=51.0,  # 51 TFLOP/s FP32: H100 PCIe datasheet
            tf32=378.0,  # 378 dense TF32: H100 PCIe datasheet, 756 with sparsity
            fp16=756.0,  # 756 dense FP16: H100 PCIe datasheet, 1,513 with sparsity
            bf16=756.0,  # 756 dense BF16: H100 PCIe datasheet, 1,513 with sparsity
            fp8_e4m3=1513.0,  # 1,513 dense FP8: H100 PCIe datasheet, 3,026 with sparsity
            fp8_e5m2=1513.0,  # same FP8 line
        ),
        source="NVIDIA H100 datasheet (PCIe column), via HPCtech copy",
        confidence="cited",
    ),
    GpuSpec(
        name="H200 SXM",
        key="h200",
        aliases=("h200-sxm", "h200-141gb"),
        compute_capability=(9, 0),
        sms=132,  # docs/gpus.md, "SM counts" (same GH100 configuration as H100 SXM)
        memory_gb=141.0,  # 141 GB HBM3e: H200 datasheet
        bandwidth_gbps=4800.0,  # 4.8 TB/s: H200 datasheet
        peak_tflops=_peaks(
            fp32=67.0,  # 67 TFLOP/s FP32: H200 datasheet (compute identical to H100 SXM)
            tf32=494.7,  # 494.7 dense TF32: H200 datasheet, 989 with sparsity
            fp16=989.4,  # 989.4 dense FP16: H200 datasheet, 1,979 with sparsity
            bf16=989.4,  # 989.4 dense BF16: H200 datasheet, 1,979 with sparsity
            fp8_e4m3=1978.9,  # 1,978.9 dense FP8: H200 datasheet, 3,958 with sparsity
            fp8_e5m2=1978.9,  # same FP8 line
        ),
        source="NVIDIA H200 datasheet (secondary copy): compute identical to H100 SXM",
        confidence="cited",
    ),
    GpuSpec(
        name="B200",
        key="b200",
        aliases=("hgx-b200", "dgx-b200", "b200-sxm"),
        compute_capability=(10, 0),
        sms=148,  # docs/gpus.md, "SM counts" [memory]
        memory_gb=180.0,  # 180 GB HBM3e usable (192 physical): HGX B200 spec table
        bandwidth_gbps=7700.0,  # 7.7 TB/s: HGX B200 spec table (other sources round to 8 TB/s)
        peak_tflops=_peaks(
            fp32=75.0,  # 75 TFLOP/s FP32: HGX B200 spec table (80 for GB200 at 1.2 kW)
            tf32=1100.0,  # 1,100 dense TF32: HGX B200 (1,000 W) spec table, 2,200 with sparsity
            fp16=2250.0,  # 2,250 dense FP16: HGX B200 spec table, 4,500 with sparsity
            bf16=2250.0,  # 2,250 dense BF16: HGX B200 spec table, 4,500 with sparsity
            fp8_e4m3=4500.0,  # 4,500 dense FP8: HGX B200 spec table, 9,000 with sparsity
            fp8_e5m2=4500.0,  # same FP8 line
        ),
        source="HGX/DGX B200 spec table (secondary copy); 1,000 W HGX SKU",
        confidence="uncertain",
        notes="GB200 NVL72 per-GPU figures are ~10% higher (TF32 1,250, BF16 2,500, FP8 5,000 dense, "
        "186 GB, 8 TB/s); which SKU a user has is unknown. SM count 148 from memory.",
    ),
    GpuSpec(
        name="A100 80GB SXM",
        key="a100-80gb",
        aliases=("a100", "a100-80", "a100-sxm4-80gb", "a100-80gb-sxm"),
        compute_capability=(8, 0),
        sms=108,  # docs/gpus.md, "SM counts"
        memory_gb=80.0,  # 80 GB HBM2e: A100 datasheet
        bandwidth_gbps=2039.0,  # 2,039 GB/s SXM (PCIe 80GB: 1,935): A100 datasheet [memory]
        peak_tflops=_peaks(
            fp32=19.5,  # 19.5 TFLOP/s FP32: A100 datasheet [memory]
            tf32=156.0,  # 156 dense TF32: A100 datasheet, 312 with sparsity [memory]
            fp16=312.0,  # 312 dense FP16: A100 datasheet, 624 with sparsity [memory]
            bf16=312.0,  # 312 dense BF16: A100 datasheet, 624 with sparsity [memory]
            fp8_e4m3=None,  # Ampere: no FP8 tensor cores
            fp8_e5m2=None,
        ),
        source="NVIDIA A100 datasheet [memory]",
        confidence="uncertain",
        notes="The 80GB PCIe card has the same compute and 1,935 GB/s; it is matched to this row.",
    ),
    GpuSpec(
        name="A100 40GB",
        key="a100-40gb",
        aliases=("a100-40", "a100-sxm4-40gb", "a100-pcie-40gb"),
        compute_capability=(8, 0),
        sms=108,  # docs/gpus.md, "SM counts"
        memory_gb=40.0,  # 40 GB HBM2: A100 datasheet
        bandwidth_gbps=1555.0,  # 1,555 GB/s: A100 datasheet, confirmed in a secondary table
        peak_tflops=_peaks(
            fp32=19.5,  # 19.5 TFLOP/s FP32: A100 datasheet [memory]
            tf32=156.0,  # 156 dense TF32: A100 datasheet, 312 with sparsity [memory]
            fp16=312.0,  # 312 dense FP16: A100 datasheet, 624 with sparsity [memory]
            bf16=312.0,  # 312 dense BF16: A100 datasheet, 624 with sparsity [memory]
            fp8_e4m3=None,  # Ampere: no FP8 tensor cores
            fp8_e5m2=None,
        ),
        source="NVIDIA A100 datasheet [memory]; bandwidth confirmed in a secondary table",
        confidence="uncertain",
        notes="SXM4 and PCIe 40GB share these figures.",
    ),
    GpuSpec(
        name="A10",
        key="a10",
        aliases=("a10-24gb",),
        compute_capability=(8, 6),
        sms=72,  # docs/gpus.md, "SM counts"
        memory_gb=24.0,  # 24 GB GDDR6: A10 datasheet
        bandwidth_gbps=600.0,  # 600 GB/s: A10 datasheet (600.2 in a secondary table)
        peak_tflops=_peaks(
            fp32=31.2,  # 31.2 TFLOP/s FP32: A10 datasheet (31.24 in a secondary table)
            tf32=62.5,  # 62.5 dense TF32: A10 datasheet, 125 with sparsity [memory]
            fp16=125.0,  # 125 dense FP16: A10 datasheet, 250 with sparsity [memory]
            bf16=125.0,  # 125 dense BF16: A10 datasheet, 250 with sparsity [memory]
            fp8_e4m3=None,  # Ampere: no FP8 tensor cores
            fp8_e5m2=None,
        ),
        source="NVIDIA A10 datasheet [memory]; FP32 and bandwidth confirmed in a secondary table",
        confidence="uncertain",
        notes="Not the AWS A10G, whose tensor rates are lower; A10G is not matched to this row.",
    ),
    GpuSpec(
        name="L4",
        key="l4",
        aliases=("l4-24gb",),
        compute_capability=(8, 9),
        sms=58,  # docs/gpus.md, "SM counts" (some spec sites say 60; 7,424 CUDA cores / 128 per SM = 58) [uncertain]
        memory_gb=24.0,  # 24 GB GDDR6: L4 datasheet
        bandwidth_gbps=300.0,  # 300 GB/s: L4 datasheet
        peak_tflops=_peaks(
            fp32=30.3,  # 30.3 TFLOP/s FP32: L4 datasheet
            tf32=60.0,  # 60 dense TF32: L4 datasheet, 120 with sparsity
            fp16=121.0,  # 121 dense FP16: L4 datasheet, 242 with sparsity
            bf16=121.0,  # 121 dense BF16: L4 datasheet, 242 with sparsity
            fp8_e4m3=242.5,  # 242.5 dense FP8: L4 datasheet, 485 with sparsity
            fp8_e5m2=242.5,  # same FP8 line
        ),
        source="NVIDIA L4 datasheet (reseller copy); 72 W",
        confidence="cited",
        notes="SM count uncertain (58 vs 60).",
    ),
    GpuSpec(
        name="L40S",
        key="l40s",
        aliases=("l40s-48gb",),
        compute_capability=(8, 9),
        sms=142,  # docs/gpus.md, "SM counts"
        memory_gb=48.0,  # 48 GB GDDR6: L40S datasheet
        bandwidth_gbps=864.0,  # 864 GB/s: L40S datasheet
        peak_tflops=_peaks(
            fp32=91.6,  # 91.6 TFLOP/s FP32: L40S datasheet
            tf32=183.0,  # 183 dense TF32: L40S datasheet, 366 with sparsity
            fp16=362.0,  # 362 dense FP16: L40S datasheet, 733 with sparsity (datasheet's own rounding)
            bf16=362.0,  # 362 dense BF16: L40S datasheet, 733 with sparsity
            fp8_e4m3=733.0,  # 733 dense FP8: L40S datasheet, 1,466 with sparsity
            fp8_e5m2=733.0,  # same FP8 line
        ),
        source="NVIDIA L40S datasheet (reseller copy of the table); 350 W",
        confidence="cited",
        notes="Not the L40 (non-S), which is not in the table.",
    ),
    GpuSpec(
        name="T4",
        key="t4",
        aliases=("t4-16gb",),
        compute_capability=(7, 5),
        sms=40,  # docs/gpus.md, "SM counts"
        memory_gb=16.0,  # 16 GB GDDR6: T4 datasheet
        bandwidth_gbps=320.0,  # 320 GB/s: T4 datasheet (confirmed in a secondary table)
        peak_tflops=_peaks(
            fp32=8.1,  # 8.1 TFLOP/s FP32: T4 datasheet [memory]
            tf32=None,  # Turing: no TF32
            fp16=65.0,  # 65 TFLOP/s FP16 mixed precision: T4 datasheet (65.13 in a secondary table)
            bf16=None,  # Turing: no BF16 tensor cores
            fp8_e4m3=None,
            fp8_e5m2=None,
        ),
        source="NVIDIA T4 datasheet [memory]; FP16 and bandwidth confirmed in a secondary table",
        confidence="uncertain",
    ),
    GpuSpec(
        name="V100 SXM2",
        key="v100-sxm2",
        aliases=("v100", "v100-sxm2-16gb", "v100-sxm2-32gb"),
        compute_capability=(7, 0),
        sms=80,  # docs/gpus.md, "SM counts"
        memory_gb=16.0,  # 16 GB HBM2 (a 32 GB variant has the same compute): V100 datasheet
        bandwidth_gbps=900.0,  # 900 GB/s: V100 datasheet [memory]
        peak_tflops=_peaks(
            fp32=15.7,  # 15.7 TFLOP/s FP32: V100 SXM2 datasheet [memory]
            tf32=None,  # Volta: no TF32
            fp16=125.0,  # 125 TFLOP/s FP16 tensor: V100 SXM2 datasheet [memory]
            bf16=None,  # Volta: no BF16
            fp8_e4m3=None,
            fp8_e5m2=None,
        ),
        source="NVIDIA V100 datasheet [memory]",
        confidence="uncertain",
        notes="16 GB and 32 GB SXM2 cards share these figures.",
    ),
    GpuSpec(
        name="V100 PCIe",
        key="v100-pcie",
        aliases=("v100-pcie-16gb", "v100-pcie-32gb"),
        compute_capability=(7, 0),
        sms=80,  # docs/gpus.md, "SM counts" (same GV100 configuration)
        memory_gb=16.0,  # 16 GB HBM2 (32 GB variant exists): V100 datasheet
        bandwidth_gbps=900.0,  # 900 GB/s: V100 datasheet [memory]
        peak_tflops=_peaks(
            fp32=14.0,  # 14 TFLOP/s FP32: V100 PCIe datasheet [memory]
            tf32=None,
            fp16=112.0,  # 112 TFLOP/s FP16 tensor: V100 PCIe datasheet [memory]
            bf16=None,
            fp8_e4m3=None,
            fp8_e5m2=None,
        ),
        source="NVIDIA V100 datasheet, PCIe column [memory]",
        confidence="uncertain",
    ),
    GpuSpec(
        name="RTX 3090",
        key="rtx-3090",
        aliases=("3090", "geforce-rtx-3090"),
        compute_capability=(8, 6),
        sms=82,  # docs/gpus.md, "SM counts"
        memory_gb=24.0,  # 24 GB GDDR6X: GA102 whitepaper
        bandwidth_gbps=936.0,  # 936 GB/s: GA102 whitepaper
        peak_tflops=_peaks(
            fp32=35.6,  # 35.6 TFLOP/s FP32: GA102 whitepaper appendix [memory]
            tf32=35.6,  # 35.6 dense TF32, 71 with sparsity: GA102 whitepaper [memory]
            fp16=71.0,  # 71 dense FP16 with FP32 accumulate (142 with FP16 accumulate): GA102 whitepaper
            bf16=71.0,  # 71 dense BF16 with FP32 accumulate: GA102 whitepaper [memory]
            fp8_e4m3=None,  # Ampere: no FP8
            fp8_e5m2=None,
        ),
        source="NVIDIA GA102 (Ampere GeForce) whitepaper appendix [memory]; cross-check: 3090 Ti FP16 "
        "FP32-acc 80 vs FP16-acc 160",
        confidence="uncertain",
        notes="GeForce: FP32-accumulate tensor rate is half the FP16-accumulate rate.",
    ),
    GpuSpec(
        name="RTX 4090",
        key="rtx-4090",
        aliases=("4090", "geforce-rtx-4090"),
        compute_capability=(8, 9),
        sms=128,  # docs/gpus.md, "SM counts"
        memory_gb=24.0,  # 24 GB GDDR6X: Ada whitepaper
        bandwidth_gbps=1008.0,  # 1,008 GB/s: Ada whitepaper
        peak_tflops=_peaks(
            fp32=82.6,  # 82.6 TFLOP/s FP32: Ada whitepaper appendix [memory]
            tf32=82.6,  # 82.6 dense TF32, 165 with sparsity: Ada whitepaper [memory]
            fp16=165.2,  # 165.2 dense FP16, FP32 accumulate (330.3 FP16 accumulate): Ada whitepaper
            bf16=165.2,  # 165.2 dense BF16, FP32 accumulate: Ada whitepaper [memory]
            fp8_e4m3=330.3,  # 330.3 dense FP8, FP32 accumulate (660.6 FP16 acc): Ada whitepaper; disputed
            fp8_e5m2=330.3,  # same FP8 line
        ),
        source="NVIDIA Ada GPU architecture whitepaper appendix [memory]",
        confidence="uncertain",
        notes="GeForce: FP32-accumulate tensor rate is half the FP16-accumulate rate. Secondary sources "
        "disagree on FP8 with FP32 accumulate (330 vs 660).",
    ),
)


def _normalise(name: str) -> str:
    """Lower-case, keep letters and digits only: ``"H100 SXM"`` -> ``"h100sxm"``."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _build_index(gpus: Iterable[GpuSpec]) -> Mapping[str, GpuSpec]:
    index: dict[str, GpuSpec] = {}
    for gpu in gpus:
        for spelling in (gpu.key, gpu.name, *gpu.aliases):
            norm = _normalise(spelling)
            other = index.get(norm)
            if other is not None and other.key != gpu.key:
                # Ambiguity is a table bug; refuse to import rather than pick one silently.
                raise ValueError(f"{spelling!r} names both {other.key} and {gpu.key}")
            index[norm] = gpu
    return types.MappingProxyType(index)


_INDEX: Mapping[str, GpuSpec] = _build_index(GPUS)
_BY_KEY: Mapping[str, GpuSpec] = types.MappingProxyType({gpu.key: gpu for gpu in GPUS})
if len(_BY_KEY) != len(GPUS):
    raise ValueError("duplicate GPU keys in GPUS")
if DEFAULT_TARGET_KEY not in _BY_KEY:
    raise ValueError(f"DEFAULT_TARGET_KEY {DEFAULT_TARGET_KEY!r} is not in GPUS")

# Vendor words a user may prefix ("NVIDIA H100", "Tesla T4", "GeForce RTX 4090").
_VENDOR_PREFIXES = ("nvidia", "tesla", "geforce")


def get_gpu(key: str) -> GpuSpec:
    """The table row with this exact key (a programming lookup; users go through :func:`resolve_target`).

    Example::

        >>> get_gpu("h100-sxm").name
        'H100 SXM'
    """
    return _BY_KEY[key]


def resolve_target(name: str) -> GpuSpec:
    """The GPU a user named on the command line or in the API.

    Case, spaces, dashes and underscores are ignored, and a leading "NVIDIA", "Tesla" or "GeForce" is
    dropped; the key, the display name and every alias are accepted.

    Example::

        >>> resolve_target("H100").key, resolve_target("rtx_4090").key, resolve_target("a100").key
        ('h100-sxm', 'rtx-4090', 'a100-80gb')

    Raises:
        OptionError: the name matches no GPU; the message lists the valid keys.
    """
    norm = _normalise(name)
    candidates = [norm]
    stripped = norm
    for prefix in _VENDOR_PREFIXES:
        if stripped.startswith(prefix) and len(stripped) > len(prefix):
            stripped = stripped[len(prefix) :]
            candidates.append(stripped)
    for candidate in candidates:
        gpu = _INDEX.get(candidate)
        if gpu is not None:
            return gpu
    raise OptionError(
        f"unknown target GPU {name!r}",
        choices=[gpu.key for gpu in GPUS],
        hint="run `precision-audit targets` to see the table with names and aliases",
    )


# Detection: CUDA device names as reported by torch / NVML, e.g. "NVIDIA H100 80GB HBM3",
# "NVIDIA A100-SXM4-40GB", "Tesla V100-SXM2-16GB", "NVIDIA GeForce RTX 4090".
# Matching is on whole tokens, so "A10" never matches "A100" and "B200" never matches "GB200".


def _tokens(device_name: str) -> list[str]:
    # MIG slices are named "<card> MIG 3g.40gb"; only the card part identifies the row.
    card = re.split(r"\bmig\b", device_name.lower(), maxsplit=1)[0]
    return [t for t in re.split(r"[^a-z0-9]+", card) if t]


def _match_key(tokens: list[str], memory_bytes: int | None) -> str | None:
    has = set(tokens)
    if "nvl" in has:
        return None  # H100 NVL / H200 NVL: different clocks and memory, not in the table
    if "h100" in has:
        return "h100-pcie" if "pcie" in has else "h100-sxm"
    if "h200" in has:
        return "h200"
    if "b200" in has:
        return "b200"
    if "a100" in has:
        if "80gb" in has:
            return "a100-80gb"
        if "40gb" in has:
            return "a100-40gb"
        if memory_bytes is not None:
            return "a100-80gb" if memory_bytes > 48 * 1024**3 else "a100-40gb"
        return "a100-80gb"  # the same default as the "a100" alias
    if "a10" in has:
        return "a10"
    if "l40s" in has:
        return "l40s"
    if "l4" in has:
        return "l4"
    if "t4" in has:
        return "t4"
    if "v100" in has:
        return "v100-pcie" if "pcie" in has else "v100-sxm2"
    if "rtx" in has:
        if "4090" in has:
            return "rtx-4090"
        if "3090" in has:
            return "rtx-3090"
    return None


def match_detected(
    device_name: str,
    compute_capability: tuple[int, int] | None = None,
    memory_bytes: int | None = None,
) -> GpuSpec | None:
    """The table row for a CUDA device name, or ``None`` if the device is not in the table.

    ``compute_capability`` (when given) must agree with the row, so a renamed or unexpected device is not
    mistaken for a known one; ``memory_bytes`` separates A100 40GB from 80GB when the name does not say.

    Example::

        >>> match_detected("NVIDIA H100 80GB HBM3", (9, 0)).key
        'h100-sxm'
        >>> match_detected("NVIDIA A10", (8, 6)).key, match_detected("NVIDIA A100-SXM4-40GB", (8, 0)).key
        ('a10', 'a100-40gb')
        >>> match_detected("NVIDIA A10G", (8, 6)) is None
        True
    """
    key = _match_key(_tokens(device_name), memory_bytes)
    if key is None:
        return None
    gpu = _BY_KEY[key]
    if compute_capability is not None:
        cc = (int(compute_capability[0]), int(compute_capability[1]))
        if cc != gpu.compute_capability:
            return None
    return gpu


def _fmt_tflops(value: float | None) -> str:
    return "—" if value is None else f"{value:g}"


def format_targets_table(gpus: Iterable[GpuSpec] = GPUS) -> str:
    """Plain-text table of the target GPUs, for ``precision-audit targets``.

    Rows whose figures are partly from memory are marked ``?`` in the ``conf`` column.

    Example::

        >>> "h100-sxm" in format_targets_table()
        True
    """
    gpus = tuple(gpus)
    headers = ("key", "name", "CC", "SMs", "memory", "bandwidth",
               "FP32", "TF32", "BF16", "FP16", "FP8", "conf")
    rows: list[tuple[str, ...]] = []
    for gpu in gpus:
        rows.append(
            (
                gpu.key,
                gpu.name,
                gpu.cc_string,
                str(gpu.sms),
                f"{gpu.memory_gb:g} GB",
                f"{gpu.bandwidth_gbps:g} GB/s",
                _fmt_tflops(gpu.peak_tflops["fp32"]),
                _fmt_tflops(gpu.peak_tflops["tf32"]),
                _fmt_tflops(gpu.peak_tflops["bf16"]),
                _fmt_tflops(gpu.peak_tflops["fp16"]),
                _fmt_tflops(gpu.peak_tflops["fp8_e4m3"]),
                "ok" if gpu.confidence == "cited" else "?",
            )
        )
    numeric = set(range(2, 11))  # right-align the numbers
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: tuple[str, ...]) -> str:
        parts = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    out = [line(headers), line(tuple("-" * w for w in widths))]
    out.extend(line(r) for r in rows)
    out.append("")
    out.append(
        "FP32..FP8 are peak TFLOP/s, dense (no 2:4 sparsity; datasheets often print 2x that), tensor cores "
        "with FP32 accumulate (FP32: plain CUDA cores); — = no tensor-core support."
    )
    out.append(
        "conf '?' = at least one figure is from memory or disputed. Sources: precision_audit/gpus.py "
        "(per-figure comments) and docs/gpus.md."
    )
    out.append("Also accepted for --target (case, spaces and dashes ignored):")
    key_width = max((len(g.key) for g in gpus), default=0)
    out.extend(f"  {g.key.ljust(key_width)}  {', '.join(g.aliases)}" for g in gpus if g.aliases)
    return "\n".join(out)
