"""TensorBoard: per-layer error and range scalars and exponent histograms, read back with EventAccumulator."""

from __future__ import annotations

import json

import pytest

from precision_audit.report.tensorboard import EVENT_SUFFIX, write_scalars


def _read(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


@pytest.fixture(scope="module")
def tiny_gpt_events(sample_audits, tmp_path_factory):
    _, out, _ = sample_audits.get("tiny_gpt")
    audit = json.loads((out / "audit.json").read_text())
    logdir = tmp_path_factory.mktemp("tb") / "audit"
    write_scalars(audit, logdir)
    return audit, logdir, _read(logdir)


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
@pytest.mark.parametrize("kind", ["local", "accumulated"])
def test_error_scalars_per_layer_in_order(tiny_gpt_events, fmt, kind):
    audit, _, acc = tiny_gpt_events
    events = acc.Scalars(f"error/{fmt}/{kind}_rel_l2")
    expected = {i: L["error"][fmt][kind]["rel_l2"] for i, L in enumerate(audit["layers"])
                if L["error"][fmt][kind] and L["error"][fmt][kind]["rel_l2"] is not None}
    assert {e.step for e in events} == set(expected), "one point per layer, step = the layer's position"
    for e in events:
        assert e.value == pytest.approx(expected[e.step], rel=1e-6, abs=1e-30), f"layer {e.step}"


def test_range_scalars_and_histograms(tiny_gpt_events):
    audit, _, acc = tiny_gpt_events
    tags = acc.Tags()
    n = len(audit["layers"])
    for tag in ("range/activation_amax", "range/gradient_amax", "range/fp16/activation_headroom_bits",
                "range/fp16/gradient_flushed_unscaled", "range/fp16/gradient_flushed_at_recommended",
                "error/fp16/local_sqnr_db", "summary/fp16/loss_rel_change"):
        assert tag in tags["scalars"], f"{tag} missing; have {sorted(tags['scalars'])}"
    assert len(acc.Scalars("range/activation_amax")) == n
    amax = {e.step: e.value for e in acc.Scalars("range/activation_amax")}
    assert amax[n - 1] == pytest.approx(audit["layers"][-1]["activation"]["amax"], rel=1e-6)
    assert {"exponents/gradient", "exponents/activation"} <= set(tags["histograms"])
    hist = {h.step: h.histogram_value for h in acc.Histograms("exponents/gradient")}
    i, L = next((i, L) for i, L in enumerate(audit["layers"]) if L["gradient"]["output"]["exponent_histogram"])
    assert hist[i].num == sum(L["gradient"]["output"]["exponent_histogram"].values())
    assert "layers/text_summary" in tags["tensors"]


def test_rewriting_replaces_the_previous_events(sample_audits, tmp_path):
    _, out, _ = sample_audits.get("mlp")
    audit = json.loads((out / "audit.json").read_text())
    write_scalars(audit, tmp_path)
    write_scalars(audit, tmp_path)
    files = list(tmp_path.glob(f"events.out.tfevents.*{EVENT_SUFFIX}"))
    assert len(files) == 1, "a second audit into the same folder replaces the first's events"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "no staging folder left behind"
    acc = _read(tmp_path)
    assert len(acc.Scalars("error/bf16/accumulated_rel_l2")) == len(audit["layers"])


def test_non_finite_values_are_left_out(sample_audits, tmp_path):
    _, out, _ = sample_audits.get("fp16_trouble")
    audit = json.loads((out / "audit.json").read_text())
    write_scalars(audit, tmp_path)
    acc = _read(tmp_path)
    steps = {e.step for e in acc.Scalars("error/fp16/accumulated_rel_l2")}
    overflowed = {i for i, L in enumerate(audit["layers"]) if L["error"]["fp16"]["accumulated"]["rel_l2"] is None}
    assert overflowed, "the sample overflows fp16 somewhere"
    assert not (steps & overflowed) and steps
