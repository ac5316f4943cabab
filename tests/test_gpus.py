"""The target GPU table: lookups, format support by compute capability, cited peaks, detection names."""

from __future__ import annotations

import dataclasses
import json
import re
import types

import pytest

from precision_audit.errors import OptionError
from precision_audit.gpus import (
    CANDIDATE_ORDER,
    DEFAULT_TARGET_KEY,
    FORMAT_NAMES,
    GPUS,
    GpuSpec,
    format_targets_table,
    get_gpu,
    match_detected,
    resolve_target,
    supported_formats,
)

KEYS = [gpu.key for gpu in GPUS]
SPELLINGS = [(gpu.key, spelling) for gpu in GPUS for spelling in (gpu.key, gpu.name, *gpu.aliases)]


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


# ------------------------------------------------------------------------------------------ table shape


def test_required_gpus_are_in_the_table() -> None:
    required = {"h100-sxm", "h100-pcie", "h200", "b200", "a100-40gb", "a100-80gb", "a10", "l4", "l40s",
                "t4", "v100-sxm2", "rtx-3090", "rtx-4090"}
    assert required <= set(KEYS), f"missing rows: {sorted(required - set(KEYS))}"


def test_keys_are_unique_and_default_exists() -> None:
    assert len(KEYS) == len(set(KEYS))
    assert get_gpu(DEFAULT_TARGET_KEY).name == "H100 SXM"


def test_no_spelling_names_two_gpus() -> None:
    """Brute force over every (key, name, alias) pair: after normalisation each names one GPU only."""
    owner: dict[str, str] = {}
    for key, spelling in SPELLINGS:
        norm = _norm(spelling)
        assert owner.setdefault(norm, key) == key, f"{spelling!r} names both {owner[norm]} and {key}"


@pytest.mark.parametrize(("key", "spelling"), SPELLINGS, ids=[f"{k}:{s}" for k, s in SPELLINGS])
def test_every_spelling_resolves_to_its_own_gpu(key: str, spelling: str) -> None:
    assert resolve_target(spelling).key == key
    assert resolve_target(spelling.upper()).key == key
    assert resolve_target(spelling.replace("-", "_")).key == key


@pytest.mark.parametrize(
    ("typed", "key"),
    [
        ("h100", "h100-sxm"),
        ("H100", "h100-sxm"),
        ("h100 pcie", "h100-pcie"),
        ("H100_PCIe", "h100-pcie"),
        ("NVIDIA H100", "h100-sxm"),
        ("a100", "a100-80gb"),
        ("a100-40gb", "a100-40gb"),
        ("a10", "a10"),
        ("v100", "v100-sxm2"),
        ("Tesla T4", "t4"),
        ("4090", "rtx-4090"),
        ("rtx4090", "rtx-4090"),
        ("RTX 4090", "rtx-4090"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("3090", "rtx-3090"),
        ("h200", "h200"),
        ("b200", "b200"),
        ("l40s", "l40s"),
        ("L4", "l4"),
    ],
)
def test_resolve_common_spellings(typed: str, key: str) -> None:
    assert resolve_target(typed).key == key


@pytest.mark.parametrize("typed", ["h1000", "rtx 5090", "a1000", "l40", "", "nvidia", "mi300x"])
def test_unknown_target_lists_valid_names(typed: str) -> None:
    with pytest.raises(OptionError) as info:
        resolve_target(typed)
    err = info.value
    assert err.choices == tuple(KEYS)
    message = str(err)
    for key in KEYS:
        assert key in message, f"valid target {key!r} missing from the error message"
    assert "precision-audit targets" in message


# --------------------------------------------------------------------------------- formats by capability


@pytest.mark.parametrize(
    ("cc", "expected"),
    [
        ((6, 1), ("fp32",)),
        ((7, 0), ("fp32", "fp16")),
        ((7, 5), ("fp32", "fp16")),
        ((8, 0), ("fp32", "tf32", "fp16", "bf16")),
        ((8, 6), ("fp32", "tf32", "fp16", "bf16")),
        ((8, 9), ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")),
        ((9, 0), ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")),
        ((10, 0), ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")),
    ],
    ids=["cc6.1", "cc7.0", "cc7.5", "cc8.0", "cc8.6", "cc8.9", "cc9.0", "cc10.0"],
)
def test_supported_formats_boundaries(cc: tuple[int, int], expected: tuple[str, ...]) -> None:
    assert supported_formats(cc) == expected


@pytest.mark.parametrize("key", ["v100-sxm2", "v100-pcie", "t4"])
def test_volta_and_turing_offer_fp16_only(key: str) -> None:
    gpu = get_gpu(key)
    assert gpu.candidate_formats() == ("fp32", "fp16")
    for fmt in ("bf16", "tf32", "fp8_e4m3", "fp8_e5m2"):
        assert not gpu.supports(fmt), f"{key} must not support {fmt}"
        assert gpu.peak(fmt) is None


@pytest.mark.parametrize("key", ["a100-80gb", "a100-40gb", "a10", "rtx-3090"])
def test_ampere_has_bf16_tf32_but_no_fp8(key: str) -> None:
    gpu = get_gpu(key)
    assert gpu.candidate_formats() == ("fp32", "tf32", "bf16", "fp16")
    assert not gpu.supports("fp8_e4m3")


@pytest.mark.parametrize("key", ["h100-sxm", "h100-pcie", "h200", "b200", "l4", "l40s", "rtx-4090"])
def test_fp8_generation_offers_fp8(key: str) -> None:
    gpu = get_gpu(key)
    assert gpu.candidate_formats() == CANDIDATE_ORDER
    assert gpu.supports("fp8_e4m3") and gpu.supports("fp8_e5m2")


def test_unknown_format_is_an_option_error() -> None:
    with pytest.raises(OptionError) as info:
        get_gpu("h100-sxm").supports("fp9")
    assert "bf16" in str(info.value)


@pytest.mark.parametrize("gpu", GPUS, ids=KEYS)
def test_peaks_present_exactly_where_supported(gpu: GpuSpec) -> None:
    assert tuple(gpu.peak_tflops) == FORMAT_NAMES
    for fmt in FORMAT_NAMES:
        assert (gpu.peak_tflops[fmt] is not None) == gpu.supports(fmt), f"{gpu.key} {fmt}"
    assert gpu.supports("fp32") and gpu.peak("fp32") is not None


@pytest.mark.parametrize("gpu", GPUS, ids=KEYS)
def test_peaks_are_ordered_by_format_width(gpu: GpuSpec) -> None:
    """A typo in the table usually breaks this: narrower formats never run slower than wider ones."""
    chain = [gpu.peak(f) for f in ("fp32", "tf32", "bf16", "fp8_e4m3") if gpu.peak(f) is not None]
    assert chain == sorted(chain), f"{gpu.key}: peaks not monotone {chain}"
    if gpu.supports("bf16"):
        assert gpu.peak("bf16") == gpu.peak("fp16")
    if gpu.supports("fp8_e4m3"):
        assert gpu.peak("fp8_e4m3") == gpu.peak("fp8_e5m2")


# Datasheet figures *with* 2:4 sparsity (docs/gpus.md, "Conventions"): the table must hold half of each.
SPARSE_DATASHEET = [
    ("h100-sxm", "bf16", 1979.0),
    ("h100-sxm", "tf32", 989.0),
    ("h100-sxm", "fp8_e4m3", 3958.0),
    ("h100-pcie", "bf16", 1513.0),
    ("h200", "fp8_e4m3", 3958.0),
    ("b200", "bf16", 4500.0),
    ("l4", "fp16", 242.0),
    ("l4", "fp8_e4m3", 485.0),
    ("l40s", "fp8_e4m3", 1466.0),
]


@pytest.mark.parametrize(
    ("key", "fmt", "sparse"), SPARSE_DATASHEET, ids=[f"{k}-{f}" for k, f, _ in SPARSE_DATASHEET]
)
def test_peaks_are_dense_half_of_sparse(key: str, fmt: str, sparse: float) -> None:
    dense = get_gpu(key).peak(fmt)
    assert dense is not None
    assert abs(2 * dense - sparse) <= 0.001 * sparse, f"{key} {fmt}: {dense} is not half of {sparse} (sparse)"


def test_h100_sxm_bf16_is_the_datasheet_figure() -> None:
    # 989.4 TFLOP/s dense BF16: H100 SXM datasheet, 1,979 with sparsity.
    assert get_gpu("h100-sxm").peak_tflops["bf16"] == 989.4


def test_peak_mapping_is_immutable() -> None:
    gpu = get_gpu("h100-sxm")
    assert isinstance(gpu.peak_tflops, types.MappingProxyType)
    with pytest.raises(TypeError):
        gpu.peak_tflops["bf16"] = 1.0  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        gpu.sms = 1  # type: ignore[misc]


def test_spec_rejects_a_peak_the_capability_cannot_have() -> None:
    v100 = get_gpu("v100-sxm2")
    peaks = dict(v100.peak_tflops, bf16=125.0)
    with pytest.raises(ValueError, match="bf16"):
        dataclasses.replace(v100, peak_tflops=peaks)


@pytest.mark.parametrize("gpu", GPUS, ids=KEYS)
def test_every_row_names_its_source_and_confidence(gpu: GpuSpec) -> None:
    assert gpu.source.strip()
    assert gpu.confidence in ("cited", "uncertain")
    if "[memory]" in gpu.source:
        assert gpu.confidence == "uncertain", f"{gpu.key} cites memory but claims {gpu.confidence}"


def test_sm_counts_follow_numerics_section_4_2() -> None:
    expected = {"v100-sxm2": 80, "t4": 40, "a10": 72, "a100-80gb": 108, "a100-40gb": 108, "l4": 58,
                "l40s": 142, "h100-sxm": 132, "h100-pcie": 114, "h200": 132, "rtx-3090": 82,
                "rtx-4090": 128, "b200": 148}
    assert {key: get_gpu(key).sms for key in expected} == expected


def test_to_dict_is_json_and_hashable() -> None:
    for gpu in GPUS:
        data = json.loads(json.dumps(gpu.to_dict()))
        assert data["key"] == gpu.key
        assert data["compute_capability"] == list(gpu.compute_capability)
        assert data["peak_tflops"]["bf16"] == gpu.peak("bf16")
    assert len({*GPUS}) == len(GPUS)


# ------------------------------------------------------------------------------------ detected devices


@pytest.mark.parametrize(
    ("device_name", "cc", "key"),
    [
        ("NVIDIA H100 80GB HBM3", (9, 0), "h100-sxm"),
        ("NVIDIA H100 PCIe", (9, 0), "h100-pcie"),
        ("NVIDIA H200", (9, 0), "h200"),
        ("NVIDIA B200", (10, 0), "b200"),
        ("NVIDIA A100-SXM4-40GB", (8, 0), "a100-40gb"),
        ("NVIDIA A100-PCIE-40GB", (8, 0), "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", (8, 0), "a100-80gb"),
        ("NVIDIA A100 80GB PCIe", (8, 0), "a100-80gb"),
        ("NVIDIA A100-SXM4-80GB MIG 3g.40gb", (8, 0), "a100-80gb"),
        ("NVIDIA A10", (8, 6), "a10"),
        ("NVIDIA L4", (8, 9), "l4"),
        ("NVIDIA L40S", (8, 9), "l40s"),
        ("Tesla T4", (7, 5), "t4"),
        ("Tesla V100-SXM2-16GB", (7, 0), "v100-sxm2"),
        ("Tesla V100-SXM2-32GB", (7, 0), "v100-sxm2"),
        ("Tesla V100-PCIE-16GB", (7, 0), "v100-pcie"),
        ("NVIDIA GeForce RTX 3090", (8, 6), "rtx-3090"),
        ("NVIDIA GeForce RTX 4090", (8, 9), "rtx-4090"),
    ],
)
def test_match_detected_names(device_name: str, cc: tuple[int, int], key: str) -> None:
    spec = match_detected(device_name, cc)
    assert spec is not None, f"{device_name!r} not matched"
    assert spec.key == key


@pytest.mark.parametrize(
    ("device_name", "cc"),
    [
        ("NVIDIA A10G", (8, 6)),  # AWS variant, lower tensor rates: not the A10 row
        ("NVIDIA A100X", (8, 0)),
        ("NVIDIA GB200", (10, 0)),  # contains "B200" but is another SKU
        ("NVIDIA GH200 480GB", (9, 0)),
        ("NVIDIA H100 NVL", (9, 0)),
        ("NVIDIA L40", (8, 9)),
        ("NVIDIA GeForce RTX 3080", (8, 6)),
        ("NVIDIA RTX A6000", (8, 6)),
        ("AMD Instinct MI300X", (9, 4)),
    ],
)
def test_match_detected_rejects_other_devices(device_name: str, cc: tuple[int, int]) -> None:
    assert match_detected(device_name, cc) is None


def test_a10_is_never_mistaken_for_a100_and_back() -> None:
    assert match_detected("NVIDIA A10", (8, 6)).key == "a10"  # type: ignore[union-attr]
    assert match_detected("NVIDIA A100-SXM4-40GB", (8, 0)).key == "a100-40gb"  # type: ignore[union-attr]
    # An A100 name with the capability of an A10 is inconsistent: no guess.
    assert match_detected("NVIDIA A100-SXM4-40GB", (8, 6)) is None


def test_match_detected_uses_memory_when_the_name_has_no_size() -> None:
    small = match_detected("NVIDIA A100", (8, 0), memory_bytes=40 * 1024**3)
    large = match_detected("NVIDIA A100", (8, 0), memory_bytes=80 * 1024**3)
    assert small is not None and small.key == "a100-40gb"
    assert large is not None and large.key == "a100-80gb"


# ---------------------------------------------------------------------------------------------- table


def test_targets_table_lists_every_gpu_and_explains_itself() -> None:
    table = format_targets_table()
    lines = table.splitlines()
    header = lines[0].split()
    assert header[:6] == ["key", "name", "CC", "SMs", "memory", "bandwidth"]
    assert {"FP32", "TF32", "BF16", "FP16", "FP8"} <= set(header)
    for gpu in GPUS:
        row = next((ln for ln in lines if ln.startswith(gpu.key + " ")), None)
        assert row is not None, f"no row for {gpu.key}"
        assert gpu.name in row
    v100_row = next(ln for ln in lines if ln.startswith("v100-sxm2 "))
    assert v100_row.count("—") == 3  # TF32, BF16, FP8
    assert "dense" in table and "docs/gpus.md" in table


def test_targets_table_accepts_a_subset() -> None:
    table = format_targets_table([get_gpu("t4")])
    assert "t4" in table and "h100-sxm" not in table
