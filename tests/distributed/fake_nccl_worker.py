"""One rank of tests/distributed/test_backend.py's fake-NCCL audit, started by torchrun (2 ranks, CPU):

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed/fake_nccl_worker.py MODEL OUT

What a GPU rank does, on the CPU: under the fake CUDA device (tests/fakecuda.py), each rank sees ONE GPU (as
under SLURM ``--gpus-per-task=1`` or CUDA_VISIBLE_DEVICES set per rank; each its own, by UUID), and the backend
the audit asks for NCCL is "fakenccl": gloo underneath, registered for CUDA tensors only, so that a collective on
a CPU tensor fails as NCCL's does ("No backend type associated with device type cpu"). The audit then runs as
``precision-audit MODEL --device cuda --out OUT`` would (precision_audit/distributed/run.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for fakecuda

import torch.distributed as dist  # noqa: E402

from fakecuda import FakeCuda, FakeDeviceProperties  # noqa: E402


def _like_nccl(store, rank, size, timeout):  # noqa: ANN001, ANN202 - torch's backend-creator signature
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def main() -> int:
    dist.Backend.register_backend("fakenccl", _like_nccl, devices=["cuda"])
    real_init = dist.init_process_group

    def init(backend=None, *args, **kwargs):  # noqa: ANN001, ANN202 - torch's signature
        return real_init(backend.replace("nccl", "fakenccl") if isinstance(backend, str) else backend,
                         *args, **kwargs)

    dist.init_process_group = init
    model, out = sys.argv[1], sys.argv[2]
    own_gpu = FakeDeviceProperties(uuid=f"GPU-0f0f0f0f-fake-cuda-0000-00000000000{os.environ['RANK']}")
    # PA_FAKE_GPUS=2: each rank sees both GPUs and takes its LOCAL_RANK'th (NCCL's CPU-tensor failure alone)
    with FakeCuda(device_count=int(os.environ.get("PA_FAKE_GPUS", "1")), props=own_gpu):
        from precision_audit.cli import main as cli

        return cli([model, "--device", "cuda", "--out", out, "-q", "--steps", "0"])


if __name__ == "__main__":
    sys.exit(main())
