"""format_pass.copy_stats: the copy of each module's format figures kept before a format pass (forget_format_pass
puts them back) is ``copy.deepcopy``'s, made cheaply; it must be equal to it and share nothing that can change."""

from __future__ import annotations

import copy
import dataclasses

from precision_audit.capture.format_pass import copy_stats
from precision_audit.capture.records import FormatLayerStats
from precision_audit.capture.stats import ErrorStats


def filled() -> FormatLayerStats:
    fs = FormatLayerStats()
    fs.accumulated.n, fs.accumulated.sum_ref2, fs.accumulated.max_abs = 10, 2.5, 0.125
    fs.local = ErrorStats(n=3, sum_diff2=1e-9)
    fs.activation.amax, fs.grad_output.nans = 3.0, 2
    fs.output_dtypes = {"torch.bfloat16"}
    fs.loss_impact, fs.calls, fs.local_note = -1e-4, 4, "why"
    return fs


def test_copy_equals_deepcopy_and_shares_no_mutable_part():
    for fs in (filled(), FormatLayerStats()):
        c = copy_stats(fs)
        assert c == copy.deepcopy(fs)
        for f in dataclasses.fields(fs):
            v = getattr(fs, f.name)
            if not isinstance(v, (int, float, str, bool, type(None))):
                assert getattr(c, f.name) is not v, f.name
        c.accumulated.n += 1
        c.output_dtypes.add("x")
        if c.local is not None:
            c.local.n += 1
        assert fs == filled() or fs == FormatLayerStats()


@dataclasses.dataclass
class _Extended(FormatLayerStats):
    """The record as a later field holding nested lists would make it."""

    extra: list = dataclasses.field(default_factory=lambda: [[1], [2]])


def test_a_field_of_another_kind_is_deep_copied():
    fs = _Extended(**{f.name: getattr(filled(), f.name) for f in dataclasses.fields(FormatLayerStats)})
    c = copy_stats(fs)
    assert c == copy.deepcopy(fs)
    assert c.extra == fs.extra and c.extra is not fs.extra and c.extra[0] is not fs.extra[0]
