"""TensorBoard (docs/report.md, "TensorBoard"), read back with EventAccumulator: the step axis is the training step
the audit looked at, never a layer index (issue 35: 25 scalar tags used the layer's position as their step); the
per-module figures are a histogram over the modules and a text table, the summary curves a custom layout."""

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


def test_every_scalar_is_at_the_training_step_not_a_layer_index(sample_audits, tmp_path):
    _, out, _ = sample_audits.get("tiny_gpt")
    audit = json.loads((out / "audit.json").read_text())
    for step in (0, 700):
        write_scalars(audit, tmp_path / str(step), step=step)
        acc = _read(tmp_path / str(step))
        assert acc.Tags()["scalars"]
        for tag in acc.Tags()["scalars"]:
            assert [e.step for e in acc.Scalars(tag)] == [step], f"{tag}: one value, at step {step}"
        for tag in acc.Tags()["histograms"]:
            assert [h.step for h in acc.Histograms(tag)] == [step], tag


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
@pytest.mark.parametrize("kind", ["local", "accumulated"])
def test_per_module_errors_are_a_histogram_and_their_worst_a_scalar(tiny_gpt_events, fmt, kind):
    audit, _, acc = tiny_gpt_events
    errs = [L["error"][fmt][kind]["rel_l2"] for L in audit["layers"]
            if L["error"][fmt][kind] and L["error"][fmt][kind]["rel_l2"] is not None]
    (worst,) = acc.Scalars(f"layers/{fmt}/worst_{kind}_rel_l2")
    assert worst.value == pytest.approx(max(errs), rel=1e-6)
    (h,) = acc.Histograms(f"error/{fmt}/{kind}_log10_rel_l2")
    assert h.histogram_value.num == sum(e > 0 for e in errs), "one value per module with a non-zero error"


def test_summary_histograms_text_and_layout(tiny_gpt_events):
    audit, _, acc = tiny_gpt_events
    tags = acc.Tags()
    for tag in ("summary/fp16/loss_rel_change", "summary/bf16/output_rel_l2", "summary/fp32/loss",
                "layers/fp16/min_headroom_bits", "loss_scale/recommended_init_scale"):
        assert tag in tags["scalars"], f"{tag} missing; have {sorted(tags['scalars'])}"
    (e,) = acc.Scalars("summary/bf16/loss_rel_change")
    assert e.value == pytest.approx(audit["summary"]["bf16"]["loss_rel_change"], rel=1e-6)
    (room,) = acc.Scalars("layers/fp16/min_headroom_bits")
    assert room.value == pytest.approx(min(L["activation"]["headroom_bits"]["fp16"] for L in audit["layers"]),
                                       rel=1e-6)
    leaves = [L for L in audit["layers"] if L["is_leaf"]]
    (g,) = acc.Histograms("exponents/gradient")
    assert g.histogram_value.num == sum(sum(L["gradient"]["output"]["exponent_histogram"].values()) for L in leaves)
    assert "layers/text_summary" in tags["tensors"]
    text = acc.Tensors("layers/text_summary")[0].tensor_proto.string_val[0].decode()
    assert text.count("\n") == len(audit["layers"]) + 1 and "`blocks.1.mlp.c_proj`" in text
    from tensorboard.plugins.custom_scalar import metadata

    assert metadata.CONFIG_SUMMARY_TAG in tags["tensors"], "the custom-scalars layout"


def test_rewriting_replaces_the_previous_events(sample_audits, tmp_path):
    _, out, _ = sample_audits.get("mlp")
    audit = json.loads((out / "audit.json").read_text())
    write_scalars(audit, tmp_path)
    write_scalars(audit, tmp_path)
    files = list(tmp_path.glob(f"events.out.tfevents.*{EVENT_SUFFIX}"))
    assert len(files) == 1, "a second audit into the same folder replaces the first's events"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "no staging folder left behind"
    acc = _read(tmp_path)
    assert len(acc.Scalars("layers/bf16/worst_accumulated_rel_l2")) == 1


def test_non_finite_values_are_left_out(sample_audits, tmp_path):
    _, out, _ = sample_audits.get("fp16_trouble")
    audit = json.loads((out / "audit.json").read_text())
    write_scalars(audit, tmp_path)
    acc = _read(tmp_path)
    assert audit["summary"]["fp16"]["loss"] is None, "the premise: the sample overflows fp16"
    assert "summary/fp16/loss" not in acc.Tags()["scalars"] and "summary/bf16/loss" in acc.Tags()["scalars"]
    finite = [L["error"]["fp16"]["accumulated"]["rel_l2"] for L in audit["layers"]
              if L["error"]["fp16"]["accumulated"]["rel_l2"] is not None]
    assert len(finite) < len(audit["layers"])
    (h,) = acc.Histograms("error/fp16/accumulated_log10_rel_l2")
    assert h.histogram_value.num == sum(e > 0 for e in finite)
