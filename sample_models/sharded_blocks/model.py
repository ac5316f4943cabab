"""Sample model ``sharded_blocks``: the 2-rank example of a distributed audit (README.md, "Distributed").

Architecture: an input projection Linear(32->64), four residual blocks (LayerNorm -> Linear(64->128) -> GELU ->
Linear(128->64), added back) in an ``nn.ModuleList``, a learned position table added to every sample (the same
tensor on every rank: it is not split along the batch), and a head Linear(64->10).

The file shows the two hooks a distributed audit reads:

- ``parallelize(model, mesh)``: the user's own FSDP2 wrapping, ``fully_shard`` on each block and on the root
  (what ``--shard fsdp`` would do; a real training script would put its own MixedPrecisionPolicy or tensor
  parallelism here);
- ``sample_batch(rank=0, world_size=1)``: rank ``rank``'s share of a global batch of 16 samples (one process
  gets all 16), so no batch file is needed.

Run it on two ranks::

    precision-audit sample_models/sharded_blocks/model.py --nproc 2
    torchrun --nproc-per-node 2 -m precision_audit sample_models/sharded_blocks/model.py

The audit equals the single-process audit of the same 16 samples (tests/distributed/test_distributed_audit.py).
"""
import torch
import torch.nn as nn

GLOBAL_BATCH = 16
TOKENS = 8
IN_FEATURES = 32
WIDTH = 64
CLASSES = 10


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.act = nn.GELU()
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


class Positions(nn.Module):
    """A learned table, one row per token position: its output is the same on every rank."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(TOKENS, WIDTH) * 0.1)

    def forward(self, n):
        return self.table[:n] * 1.0


class ShardedBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(IN_FEATURES, WIDTH)
        self.positions = Positions()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        h = self.embed(x) + self.positions(x.shape[1])
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=1))


def build_model():
    torch.manual_seed(0)
    return ShardedBlocks()


def sample_batch(rank=0, world_size=1):
    """Rank ``rank``'s contiguous share of the global batch: ``(inputs [16/world_size, 8, 32], labels)``."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(GLOBAL_BATCH, TOKENS, IN_FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=g)
    share = GLOBAL_BATCH // world_size
    return x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


def parallelize(model, mesh):
    """FSDP2 on each block, then on the root (the same units ``--shard fsdp`` would make)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
