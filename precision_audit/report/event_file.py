"""A TensorBoard event file written directly: the audit's few protobuf messages encoded by hand, in TFRecord framing.

``torch.utils.tensorboard`` (and the ``tensorboard`` package's compiled protobuf modules) cost a process 0.2-0.3 s
to import, more than writing the events themselves (docs/performance.md, "After the passes"). The audit writes
five kinds of values only, so they are encoded here, field by field, as protobuf encodes them (the bytes are the
same: tests/report/test_event_file.py builds every message with the ``tensorboard`` package and compares):

- the record: ``u64 length``, ``u32 masked CRC-32C of those 8 bytes``, the data, ``u32 masked CRC-32C of the
  data``, little-endian (TFRecord, as ``tensorboard.summary.writer.record_writer`` writes it);
- ``tensorboard.Event`` (event.proto): wall_time 1 (double), step 2 (int64), file_version 3, summary 5,
  source_metadata 10 (its writer 1);
- ``tensorboard.Summary`` (summary.proto): value 1, each a ``Summary.Value``: tag 1, then one of simple_value 2
  (float), histo 5 (``HistogramProto``: min 1, max 2, num 3, sum 4, sum_squares 5, bucket_limit 6, bucket 7, all
  double, the last two packed), tensor 8 (``TensorProto``: dtype 1, tensor_shape 2 with dim 2 of size 1,
  string_val 8); metadata 9 (plugin_data 1: plugin_name 1, content 2);
- the custom-scalars ``Layout`` (tensorboard/plugins/custom_scalar/layout.proto): category 2, each a title 1 and
  charts 2, each a title 1 and a multiline chart 2 of tags 1.

Proto3 leaves a scalar field out when it holds its default (0, 0.0, ""), except in a oneof (``simple_value``);
a message field set to an empty message is written, empty.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence


def _crc_table() -> tuple[int, ...]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # CRC-32C (Castagnoli), reflected
        table.append(c)
    return tuple(table)


_CRC = _crc_table()


def crc32c(data: bytes) -> int:
    """CRC-32C of ``data`` (RFC 3720, appendix B.4: ``crc32c(b"123456789") == 0xE3069283``)."""
    crc, table = 0xFFFFFFFF, _CRC
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """The CRC TFRecord stores: rotated right by 15 bits, plus a constant (so that a CRC of data holding CRCs is
    not trivially zero)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tf_record(data: bytes) -> bytes:
    """One record of the event file (TFRecord framing)."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


# --- protobuf's wire format ------------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64: a negative value as its 64-bit two's complement, as protobuf writes it
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _message(field: int, payload: bytes) -> bytes:
    """A length-delimited field (a message, a string, bytes, a packed list), written even when empty."""
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _string(field: int, text: str | bytes) -> bytes:
    data = text.encode("utf-8") if isinstance(text, str) else text
    return _message(field, data) if data else b""


def _int(field: int, n: int) -> bytes:
    return _varint(field << 3) + _varint(n) if n else b""


def _double(field: int, x: float) -> bytes:
    data = struct.pack("<d", x)
    return _varint(field << 3 | 1) + data if data != bytes(8) else b""  # -0.0 is not the default: written


def _float32(x: float) -> bytes:
    """``x`` as a float32 rounded to nearest, as protobuf stores a float field (beyond float32's range: inf)."""
    try:
        return struct.pack("<f", x)
    except OverflowError:
        return struct.pack("<f", float("inf") if x > 0 else float("-inf"))


def _doubles(field: int, xs: Sequence[float]) -> bytes:
    return _message(field, struct.pack(f"<{len(xs)}d", *xs)) if xs else b""


# --- the audit's messages -------------------------------------------------------------------------------


def scalar_value(tag: str, value: float) -> bytes:
    """A ``Summary.Value`` holding a scalar (``simple_value``: float32; in a oneof, so written even when 0)."""
    return _string(1, tag) + _varint(2 << 3 | 5) + _float32(value)


def histogram_value(tag: str, min: float, max: float, num: float, sum: float, sum_squares: float,  # noqa: A002
                    bucket_limits: Sequence[float], bucket_counts: Sequence[float]) -> bytes:
    """A ``Summary.Value`` holding a ``HistogramProto`` (bucket i: values below ``bucket_limits[i]``)."""
    histo = (_double(1, float(min)) + _double(2, float(max)) + _double(3, float(num)) + _double(4, float(sum))
             + _double(5, float(sum_squares)) + _doubles(6, [float(x) for x in bucket_limits])
             + _doubles(7, [float(x) for x in bucket_counts]))
    return _string(1, tag) + _message(5, histo)


def _plugin(name: str, content: bytes = b"") -> bytes:
    return _message(9, _message(1, _string(1, name) + _string(2, content)))  # metadata.plugin_data


def _string_tensor(data: bytes, dims: Iterable[int]) -> bytes:
    shape = b"".join(_message(2, _int(1, d)) for d in dims)
    return _message(8, _int(1, 7) + _message(2, shape) + _message(8, data))  # dtype 7: DT_STRING


def text_value(tag: str, text: str) -> bytes:
    """The text plugin's ``Summary.Value`` (tag ``<tag>/text_summary``, a string tensor of shape [1], the plugin's
    data ``TextPluginData(version=0)``, which encodes to nothing)."""
    return _string(1, tag + "/text_summary") + _string_tensor(text.encode("utf-8"), [1]) + _plugin("text")


def custom_scalars_value(layout: Mapping[str, Mapping[str, tuple[str, Sequence[str]]]]) -> bytes:
    """The custom-scalars plugin's layout (``{category: {chart title: ("Multiline", [tag regex, ...])}}``), as
    ``SummaryWriter.add_custom_scalars`` writes it (tag ``custom_scalars__config__``, a scalar string tensor)."""
    categories = b""
    for title, charts in layout.items():
        body = _string(1, title)
        for chart, (kind, tags) in charts.items():
            if kind != "Multiline":
                raise ValueError(f"only multiline charts are written, not {kind!r}")
            body += _message(2, _string(1, chart) + _message(2, b"".join(_message(1, t.encode()) for t in tags)))
        categories += _message(2, body)
    return _string(1, "custom_scalars__config__") + _string_tensor(categories, []) + _plugin("custom_scalars")


def summary_event(wall_time: float, step: int, values: Iterable[bytes]) -> bytes:
    """An ``Event`` holding a ``Summary`` of ``values`` (encoded ``Summary.Value`` messages)."""
    return _double(1, wall_time) + _int(2, step) + _message(5, b"".join(_message(1, v) for v in values))


def file_version_event(wall_time: float, writer: str) -> bytes:
    """The event that opens every event file (``brain.Event:2``), naming the program that wrote it."""
    return _double(1, wall_time) + _string(3, "brain.Event:2") + _message(10, _string(1, writer))
