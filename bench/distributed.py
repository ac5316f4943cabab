"""Issue 15's benchmark: the same global batch audited in 1 process and on 2 ranks (DDP and FSDP2).

For each run it prints the wall time, every process's peak resident memory (VmHWM from /proc, polled; each rank
and the launcher apart) and whether audit.json equals the single-process one (precision_audit/distributed/
compare.py: counts exact, error metrics within 1e-6 relative). Every process runs one CPU thread, so that the
FP32 GEMMs of the ranks and of the single process sum in the same order.

    python bench/distributed.py [--width 1024] [--blocks 4] [--batch 16]

The model (written to a temporary folder) is a residual MLP of ``--blocks`` blocks of ``--width`` in an
``nn.ModuleList``, so that ``--shard fsdp`` gives one FSDP unit per block. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = '''
import torch
import torch.nn as nn

WIDTH, BLOCKS, BATCH = {width}, {blocks}, {batch}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 16)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build_model():
    torch.manual_seed(0)
    return Net()


def sample_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 16, (BATCH,), generator=g)
'''


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append(int(d))
    return out


def _hwm(pid: int) -> tuple[int | None, str]:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None, ""
    kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), None)
    rank = next((e.decode().split("=", 1)[1] for e in env if e.startswith(b"RANK=")), "")
    return (kb * 1024 if kb is not None else None), rank


def run(args: list[str], env: dict[str, str]) -> tuple[float, dict[str, int], int]:
    """Wall time, peak RSS per process (by rank, "launcher" for the rest), exit code."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "precision_audit", *args, "-q"], env=env, cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, tuple[int, str]] = {}
    while p.poll() is None:
        todo, seen = [p.pid], set()
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            todo += _children(pid)
            hwm, rank = _hwm(pid)
            if hwm is not None:
                peaks[pid] = (max(hwm, peaks.get(pid, (0, ""))[0]), rank or peaks.get(pid, (0, ""))[1])
        time.sleep(0.2)
    err = p.stderr.read() if p.stderr else ""
    wall = time.perf_counter() - t0
    if p.returncode not in (0, 1):
        print(err[-2000:], file=sys.stderr)
    by: dict[str, int] = {}
    for hwm, rank in peaks.values():
        key = f"rank {rank}" if rank else "launcher"
        by[key] = max(by.get(key, 0), hwm)
    return wall, by, p.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    a = ap.parse_args()
    from precision_audit.distributed.compare import differences

    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model.py"
        model.write_text(MODEL.format(width=a.width, blocks=a.blocks, batch=a.batch))
        params = a.blocks * (2 * a.width * a.width + 4 * a.width) + 16 * a.width + 16
        print(f"model: {a.blocks} residual blocks of {a.width}, {params:,} parameters "
              f"({params * 4 / 2**20:.1f} MiB in FP32), global batch {a.batch}")
        rows = []
        ref = None
        for label, extra in (("1 process", []), ("2 ranks, DDP", ["--nproc", "2"]),
                             ("2 ranks, FSDP2", ["--nproc", "2", "--shard", "fsdp"])):
            out = Path(tmp) / label.replace(" ", "_").replace(",", "")
            wall, peaks, code = run([str(model), "--out", str(out), *extra], env)
            audit = json.loads((out / "audit.json").read_text()) if (out / "audit.json").exists() else None
            if ref is None:
                ref = audit
                equal = "reference"
            else:
                d = differences(ref, audit) if audit and ref else ["no audit.json"]
                equal = "equal" if not d else f"{len(d)} difference(s), e.g. {d[0]}"
            ranks = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sorted(peaks.items()))
            rows.append((label, wall, ranks, equal, code))
        print("\n| run | wall time | peak RSS per process | audit.json vs 1 process |\n|---|---|---|---|")
        for label, wall, ranks, equal, code in rows:
            print(f"| {label} | {wall:.1f} s | {ranks} | {equal} (exit {code}) |")


if __name__ == "__main__":
    main()
