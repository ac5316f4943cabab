"""The audit process's allocator settings (precision_audit/allocator.py): a block freed by one pass is reused by
the next instead of being faulted in again, and a setting the user made is left alone. Each case runs in a
subprocess: the settings are process-wide and cannot be undone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from precision_audit.allocator import return_freed_memory, reuse_freed_memory

CHURN = r'''
import json, resource, sys
import torch
from precision_audit import allocator
made = {"reuse": allocator.reuse_freed_memory, "return": allocator.return_freed_memory,
        "none": lambda: False}[sys.argv[1]]()
w = torch.randn(1024, 2048)  # 8 MiB, as a layer's weight
torch.ones(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    r = w.half().float()  # a rounded copy per emulated GEMM: 4 MiB and 8 MiB blocks, freed at once
    del r
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"made": made, "faults": faults}))
'''


def _churn(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    pages = (8 << 20) // 4096  # one 8 MiB block, in 4 KiB pages
    reuse, own = _churn("reuse"), _churn("return")
    assert reuse["made"] and own["made"]
    # own mappings: every copy faults in its 12 MiB again (40 x 3072 pages, 480 MiB); reused: the first few
    # copies' pages (measured: ~9,000 pages, 36 MiB), then the same heap blocks again
    assert own["faults"] > 40 * pages, own
    assert reuse["faults"] < 6 * pages, reuse


def test_a_users_setting_is_left_alone(monkeypatch):
    for var in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
        monkeypatch.setenv(var, "65536")
        assert reuse_freed_memory() is False and return_freed_memory() is False
        monkeypatch.delenv(var)
