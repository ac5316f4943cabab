"""The number formats the audit knows: their names, the orders they are used in, and their limits.

This is the one format vocabulary of the package. :class:`Format` is a ``str`` enum: ``Format.FP16 == "fp16"``
and both hash alike, so a dict keyed by formats answers a lookup by name too (policy.json and the GPU table
hold names). Each order the package uses (policy formats, what autocast runs, planner candidates, the GPU
table's columns) is a named tuple below; :func:`names` gives the names JSON and the command line write.

Limits come from ``torch.finfo`` where a storage dtype exists; TF32 (a compute mode, not a dtype) is
derived from its bit layout (1 sign, 8 exponent, 10 mantissa bits). The rounding thresholds below are
exact for round-to-nearest-even and are checked against brute-force torch casts in the tests. Write a
format's limit as ``SPECS[Format.FP16].max``, never as the literal (65504).

Importing this module imports no torch: :data:`SPECS` and :data:`LOW_PRECISION_DTYPES` are built on first use,
so the GPU table (precision_audit/gpus.py) and the command line read the vocabulary without torch's import.

Example::

    >>> SPECS[Format.FP16].max, SPECS[Format.FP16].min_subnormal == 2.0**-24
    (65504.0, True)
    >>> names(AUTOCAST_FORMATS)
    ('fp32', 'tf32', 'bf16', 'fp16')
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import OptionError

if TYPE_CHECKING:  # pragma: no cover - typing only; torch is imported where the limits are built
    import torch


class Format(str, enum.Enum):
    """A numeric format; its value is the name used in JSON and on the command line."""

    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class FormatSpec:
    """Limits of one format.

    ``zero_below``, ``normal_from`` and ``overflow_from`` are float32 thresholds on |x| for a value
    stored in this format with round-to-nearest-even:

    - |x| < zero_below          -> rounds to 0 (flushed);
    - zero_below <= |x| < normal_from -> a subnormal (reduced precision);
    - |x| >= overflow_from      -> inf (or, for e4m3fn which has no inf, saturates / NaN).
    """

    format: Format
    dtype: torch.dtype | None  # storage dtype; None for TF32 (a compute mode)
    mantissa_bits: int
    max: float
    min_normal: float
    min_subnormal: float
    has_inf: bool

    @property
    def eps(self) -> float:
        return 2.0 ** -self.mantissa_bits

    @property
    def unit_roundoff(self) -> float:
        return 2.0 ** -(self.mantissa_bits + 1)

    @property
    def zero_below(self) -> float:
        # min_subnormal / 2 is a tie between 0 (even) and min_subnormal (odd): it goes to 0.
        return _next_up(self.min_subnormal / 2)

    @property
    def normal_from(self) -> float:
        # The midpoint between the largest subnormal (odd mantissa) and min_normal (even) rounds up.
        return self.min_normal - self.min_subnormal / 2

    @property
    def overflow_from(self) -> float:
        ulp_max = 2.0 ** (math.floor(math.log2(self.max)) - self.mantissa_bits)
        mid = self.max + ulp_max / 2
        # At the tie, RNE picks the even neighbour. IEEE-like formats have an all-ones (odd) mantissa at
        # max, so the tie goes up to 2^(emax+1) = overflow; e4m3fn's max (1.110b * 2^8) is even.
        max_mantissa_odd = (self.max / ulp_max) % 2 == 1
        return mid if max_mantissa_odd else _next_up(mid)


@functools.lru_cache(maxsize=64)  # a few thresholds, read per module and format by the analysis (two tensors each)
def _next_up(x: float) -> float:
    """The next float32 above x (x must be exactly representable in float32)."""
    import torch

    t = torch.tensor(x, dtype=torch.float32)
    return float(torch.nextafter(t, torch.tensor(math.inf, dtype=torch.float32)))


def _from_finfo(fmt: Format, dtype: torch.dtype, mantissa_bits: int, has_inf: bool) -> FormatSpec:
    import torch

    fi = torch.finfo(dtype)
    return FormatSpec(
        format=fmt,
        dtype=dtype,
        mantissa_bits=mantissa_bits,
        max=float(fi.max),
        min_normal=float(fi.smallest_normal),
        # finfo has no smallest subnormal; it is min_normal * 2^-mantissa_bits for every IEEE-like format.
        min_subnormal=float(fi.smallest_normal) * 2.0 ** -mantissa_bits,
        has_inf=has_inf,
    )


def _build_specs() -> dict[Format, FormatSpec]:
    import torch

    return {
        Format.FP32: _from_finfo(Format.FP32, torch.float32, 23, True),
        # TF32: fp32's exponent range with a 10-bit mantissa; inputs to Tensor Core GEMMs are rounded to it.
        Format.TF32: FormatSpec(
            format=Format.TF32,
            dtype=None,
            mantissa_bits=10,
            max=(2.0 - 2.0**-10) * 2.0**127,
            min_normal=2.0**-126,
            min_subnormal=2.0**-136,
            has_inf=True,
        ),
        Format.BF16: _from_finfo(Format.BF16, torch.bfloat16, 7, True),
        Format.FP16: _from_finfo(Format.FP16, torch.float16, 10, True),
        Format.FP8_E4M3: _from_finfo(Format.FP8_E4M3, torch.float8_e4m3fn, 3, False),
        Format.FP8_E5M2: _from_finfo(Format.FP8_E5M2, torch.float8_e5m2, 2, True),
    }


# --- The orders the package uses formats in (one place; the names: names(...)) -----------------------------

#: Every format, widest first (the enum's order): the formats policy.json may name.
ALL_FORMATS: tuple[Format, ...] = tuple(Format)

#: What autocast can run a module in (torch.autocast has no fp8): the runtime's formats, and the ones the cost
#: model estimates.
AUTOCAST_FORMATS: tuple[Format, ...] = (Format.FP32, Format.TF32, Format.BF16, Format.FP16)

#: The formats offered to the planner, widest first (``fp8_e5m2`` is a backward-pass format paired with
#: ``fp8_e4m3``, so it is not a candidate of its own).
CANDIDATE_FORMATS: tuple[Format, ...] = (Format.FP32, Format.TF32, Format.BF16, Format.FP16, Format.FP8_E4M3)

#: The 16-bit formats autocast runs: the audit's low-precision passes and the planner's rules.
LOW_PRECISION_FORMATS: tuple[Format, ...] = (Format.FP16, Format.BF16)

# Formats whose values are stored in a narrower dtype than fp32, so range statistics apply (and the report's
# range chart draws their bands).
RANGE_FORMATS: tuple[Format, ...] = (Format.FP16, Format.BF16, Format.FP8_E4M3, Format.FP8_E5M2)

#: Formats the capture stage runs as whole passes: fp16 and bf16 under autocast, and tf32 (fp32 with every GEMM's
#: inputs rounded to TF32; docs/emulation.md, "TF32"). FP8 is measured by its own stage (precision_audit/fp8/).
CAPTURE_FORMATS: tuple[Format, ...] = (*LOW_PRECISION_FORMATS, Format.TF32)

#: The formats an audit measures when ``--formats`` is not given. TF32 runs only when asked for
#: (``--formats fp16,bf16,tf32``), so that a default audit measures what it always did.
DEFAULT_FORMATS: tuple[Format, ...] = (Format.FP16, Format.BF16)

#: The columns of the GPU table (precision_audit/gpus.py), in the datasheets' order: fp16 before bf16. It is
#: written into audit.json (``target.supported_formats``), so it stays as it is.
GPU_TABLE_FORMATS: tuple[Format, ...] = (Format.FP32, Format.TF32, Format.FP16, Format.BF16, Format.FP8_E4M3,
                                         Format.FP8_E5M2)


def names(formats: Iterable[Format]) -> tuple[str, ...]:
    """The names JSON and the command line use: ``names(LOW_PRECISION_FORMATS) == ("fp16", "bf16")``."""
    return tuple(Format(f).value for f in formats)


#: The limits of every format (built on first use, from torch.finfo).
SPECS: dict[Format, FormatSpec]
#: The storage dtype of each of :data:`LOW_PRECISION_FORMATS` (keyed by :class:`Format`; a name works too).
LOW_PRECISION_DTYPES: dict[Format, torch.dtype]


def __getattr__(name: str) -> object:
    """:data:`SPECS` and :data:`LOW_PRECISION_DTYPES`, built on first use (the module imports no torch)."""
    if name == "SPECS":
        value: object = _build_specs()
    elif name == "LOW_PRECISION_DTYPES":
        value = {f: _specs()[f].dtype for f in LOW_PRECISION_FORMATS}
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def _specs() -> dict[Format, FormatSpec]:
    specs = globals().get("SPECS")
    return specs if specs is not None else __getattr__("SPECS")  # type: ignore[return-value]


def spec(fmt: Format | str) -> FormatSpec:
    return _specs()[parse_format(fmt)]


def parse_format(name: Format | str) -> Format:
    """``"bf16"`` -> ``Format.BF16``; unknown names raise :class:`OptionError` listing the valid ones."""
    if isinstance(name, Format):
        return name
    key = str(name).strip().lower().replace("-", "_")
    aliases = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16", "fp8": "fp8_e4m3",
               "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2"}
    key = aliases.get(key, key)
    try:
        return Format(key)
    except ValueError:
        raise OptionError(
            f"unknown format {name!r}",
            choices=[f.value for f in Format],
            hint="pass formats as a comma-separated list, e.g. --formats fp16,bf16",
        ) from None


def parse_formats(text: str) -> tuple[Format, ...]:
    """Parse ``--formats fp16,bf16``; duplicates are dropped, order kept."""
    out: list[Format] = []
    for part in text.split(","):
        if not part.strip():
            continue
        f = parse_format(part)
        if f not in out:
            out.append(f)
    if not out:
        raise OptionError("--formats is empty", choices=[f.value for f in CAPTURE_FORMATS],
                          hint="e.g. --formats fp16,bf16")
    return tuple(out)


def headroom_bits(fmt: Format, amax: float) -> float | None:
    """log2(max / amax): how many doublings the largest magnitude can take before it overflows."""
    if not (amax > 0) or not math.isfinite(amax):
        return None
    return math.log2(_specs()[fmt].max / amax)
