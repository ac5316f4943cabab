"""The event file written by hand (precision_audit/report/event_file.py) against the ``tensorboard`` package: CRC-32C
on the RFC's vectors and tensorboard's own, every message byte for byte as protobuf encodes what SummaryWriter
built, the file read back by tensorboard's record reader (which checks both CRCs of every record), and neither
``torch.utils.tensorboard`` nor ``tensorboard`` imported by the audit's writer."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from precision_audit.report import event_file as E
from precision_audit.report.tensorboard import write_scalars


@pytest.mark.parametrize(("data", "crc"), [
    (b"", 0x00000000),
    (b"123456789", 0xE3069283),          # the check value of CRC-32C
    (bytes(32), 0x8A9136AA),             # RFC 3720, appendix B.4: 32 bytes of zeros
    (b"\xff" * 32, 0x62A8AB43),          # ... of ones
    (bytes(range(32)), 0x46DD794E),      # ... incrementing
    (bytes(range(31, -1, -1)), 0x113FDB5C),  # ... decrementing
], ids=["empty", "check", "zeros", "ones", "incrementing", "decrementing"])
def test_crc32c_known_vectors(data, crc):
    assert E.crc32c(data) == crc


def test_masked_crc_is_tensorboards():
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    rng = random.Random(0)
    for n in (0, 1, 7, 8, 100, 4097):
        data = bytes(rng.randrange(256) for _ in range(n))
        assert E.masked_crc32c(data) == masked_crc32c(data), n


SCALARS = [0.0, -0.0, 1.5, -2.75, 1e-45, 1e-50, 3.4028234663852886e38, 3.4028235e38, 1e39, -1e39, 5.06e-05,
           2.0 ** 48, 123456789.123]


@pytest.mark.parametrize("value", SCALARS, ids=[repr(v) for v in SCALARS])
def test_scalar_is_protobufs(value):
    from torch.utils.tensorboard.summary import scalar

    (ref,) = scalar("summary/bf16/loss_rel_change", value).value
    assert E.scalar_value("summary/bf16/loss_rel_change", value) == ref.SerializeToString()


@pytest.mark.parametrize("hist", [
    dict(min=0.0, max=1.0, num=1, sum=0.0, sum_squares=0.0, bucket_limits=[1.0], bucket_counts=[1]),
    dict(min=-150.0, max=-3.0, num=70001, sum=-123456.0, sum_squares=9.5e9,
         bucket_limits=[-149.0, -20.0, -3.0], bucket_counts=[1, 70000, 0]),
    dict(min=-0.0, max=2.0 ** 60, num=2 ** 53, sum=1e300, sum_squares=float("inf"), bucket_limits=[],
         bucket_counts=[]),
], ids=["zeros left out", "negative", "edges"])
def test_histogram_is_protobufs(hist):
    from torch.utils.tensorboard.summary import histogram_raw

    (ref,) = histogram_raw("exponents/gradient", **hist).value
    assert E.histogram_value("exponents/gradient", **hist) == ref.SerializeToString()


@pytest.mark.parametrize("text", ["", "| # | module |\n|---|---|\n| 0 | `blocks.0` — ÿ ✓ |", "x" * 70000])
def test_text_is_protobufs(text):
    from torch.utils.tensorboard.summary import text as text_summary

    (ref,) = text_summary("layers", text).value
    assert E.text_value("layers", text) == ref.SerializeToString()


def test_custom_scalars_layout_is_protobufs():
    from torch.utils.tensorboard.summary import custom_scalars

    layout = {"precision-audit": {"loss change": ("Multiline", [r"summary/.*/loss_rel_change"]),
                                  "two tags, none": ("Multiline", ["a/.*", "b"]), "empty": ("Multiline", [])},
              "another category": {"ü": ("Multiline", ["x"])}, "no charts": {}}
    (ref,) = custom_scalars({k: {c: list(v) for c, v in charts.items()} for k, charts in layout.items()}).value
    assert E.custom_scalars_value(layout) == ref.SerializeToString()
    with pytest.raises(ValueError, match="multiline"):
        E.custom_scalars_value({"c": {"m": ("Margin", ["a", "b", "c"])}})


@pytest.mark.parametrize("step", [0, 1, 700, 2 ** 40, -5])
def test_events_are_protobufs(step):
    from tensorboard.compat.proto import event_pb2, summary_pb2

    values = [E.scalar_value("a", 1.0), E.scalar_value("b", 0.0)]
    ref = event_pb2.Event(wall_time=1795838258.123, step=step,
                          summary=summary_pb2.Summary(value=[summary_pb2.Summary.Value.FromString(v)
                                                             for v in values]))
    assert E.summary_event(1795838258.123, step, values) == ref.SerializeToString()
    ref = event_pb2.Event(wall_time=1795838258.5, file_version="brain.Event:2",
                          source_metadata=event_pb2.SourceMetadata(writer="precision_audit.report.tensorboard"))
    assert E.file_version_event(1795838258.5, "precision_audit.report.tensorboard") == ref.SerializeToString()


def test_the_file_reads_back_record_by_record(sample_audits, tmp_path):
    """tensorboard's own record reader checks the length's and the data's CRC of every record; each record is one
    Event, in SummaryWriter's order: the version, the values at the step, the text at the step, the layout."""
    from tensorboard.compat.proto import event_pb2
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New

    _, out, _ = sample_audits.get("tiny_gpt")
    path = write_scalars(json.loads((out / "audit.json").read_text()), tmp_path, step=700)
    reader, events = PyRecordReader_New(str(path)), []
    while True:
        try:
            reader.GetNext()
        except Exception as e:  # tensorboard's OutOfRangeError at the end; a CRC failure is a DataLossError
            assert type(e).__name__ == "OutOfRangeError", e
            break
        events.append(event_pb2.Event.FromString(reader.record()))
    assert [e.WhichOneof("what") for e in events] == ["file_version", "summary", "summary", "summary"]
    assert events[0].file_version == "brain.Event:2"
    assert [e.step for e in events[1:]] == [700, 700, 0]
    assert events[2].summary.value[0].tag == "layers/text_summary"
    assert events[3].summary.value[0].tag == "custom_scalars__config__"
    tampered = bytearray(path.read_bytes())
    tampered[-5] ^= 1  # a bit of the last record's data: its CRC no longer matches
    path.write_bytes(bytes(tampered))
    reader = PyRecordReader_New(str(path))
    with pytest.raises(Exception, match="crc32"):
        for _ in events:
            reader.GetNext()


def test_writing_imports_no_tensorboard(sample_audits, tmp_path):
    """The writer imports neither torch.utils.tensorboard (0.2-0.3 s) nor the tensorboard package."""
    _, out, _ = sample_audits.get("mlp")
    code = ("import json, sys\nfrom pathlib import Path\nfrom precision_audit.report.tensorboard import write_scalars\n"
            f"write_scalars(json.loads(Path({str(out / 'audit.json')!r}).read_text()), Path({str(tmp_path)!r}))\n"
            "print(sorted(m for m in sys.modules if m.startswith(('tensorboard', 'torch.utils.tensorboard'))))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                       check=True)
    assert p.stdout.strip() == "[]", p.stdout
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
