"""Sample model ``tiny_gpt``: a tiny GPT-style causal language model (2 blocks, pre-LayerNorm).

Architecture (defaults in ``GPTConfig``: vocab_size=257, block_size=32, n_layer=2, n_head=4,
d_model=64):
    wte  Embedding(257, 64)      token embedding
    wpe  Embedding(32, 64)       position embedding
    blocks.{i}                   Block: x + attn(ln_1(x)), then x + mlp(ln_2(x))
        .attn  CausalSelfAttention: c_attn Linear(64->192) -> causal attention -> c_proj Linear(64->64)
               blocks.0 computes the scores explicitly (``q @ k.transpose(-2, -1) * scale``, masked_fill,
               softmax, ``att @ v``); blocks.1 calls ``F.scaled_dot_product_attention(is_causal=True)``.
               (``attn_impl="alternate"``: even blocks explicit, odd blocks SDPA; "explicit"/"sdpa" force one.)
        .mlp   MLP: c_fc Linear(64->256) -> GELU -> c_proj Linear(256->64)
    ln_f LayerNorm(64)
    lm_head Linear(64, 257, bias=False)   -- NOT weight-tied to wte

``forward(idx)`` takes int64 token ids [B, T] and returns logits [B, T, 257].
``loss_fn(output, batch)`` is cross-entropy over the flattened logits and targets.
Batch: ``(idx, targets)``, both int64 [4, 32]; targets are idx shifted by one token.

What the audit should find: the LM head's vocab_size 257 is not a multiple of 8 (nor 16/64), so the
alignment check should flag ``lm_head`` (out_features / the logits' last dim) and suggest padding to
264 (or 320 for 64-alignment); the embedding ``wte`` has the same 257 rows. The largest reduced-precision
errors are expected in the attention scores/softmax and the LM head logits (softmax + cross-entropy are
run in FP32 under autocast). The explicit attention path (blocks.0) materialises the [B, H, T, T] score
matrix as ordinary matmul/softmax ops, while blocks.1 uses the fused SDPA kernel -- both should be
captured and compared. No overflow is expected at this size.
"""
import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

SEED = 0
BATCH_SIZE = 4


@dataclass
class GPTConfig:
    vocab_size: int = 257
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    mlp_ratio: int = 4
    bias: bool = True
    # "alternate": even-numbered blocks use explicit q @ k^T attention, odd-numbered blocks use SDPA.
    # "explicit" / "sdpa": every block uses that implementation.
    attn_impl: str = "alternate"


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention.

    ``use_sdpa=False``: explicit ``q @ k.transpose(-2, -1)`` scores, causal mask, softmax, ``@ v``.
    ``use_sdpa=True``: ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)``.
    """

    def __init__(self, config: GPTConfig, use_sdpa: bool = False):
        super().__init__()
        assert config.d_model % config.n_head == 0
        self.n_head = config.n_head
        self.d_model = config.d_model
        self.head_dim = config.d_model // config.n_head
        self.use_sdpa = use_sdpa
        self.c_attn = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.c_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        if not use_sdpa:
            mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
            self.register_buffer("mask", mask.view(1, 1, config.block_size, config.block_size),
                                 persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.d_model, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # [B, H, T, hd]
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        if self.use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.c_fc = nn.Linear(config.d_model, hidden, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(hidden, config.d_model, bias=config.bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, use_sdpa: bool = False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config, use_sdpa=use_sdpa)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


def _use_sdpa(config: GPTConfig, i: int) -> bool:
    if config.attn_impl == "alternate":
        return i % 2 == 1
    if config.attn_impl == "sdpa":
        return True
    if config.attn_impl == "explicit":
        return False
    raise ValueError(f"attn_impl must be 'alternate', 'explicit' or 'sdpa', not {config.attn_impl!r}")


class TinyGPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.block_size, config.d_model)
        self.blocks = nn.ModuleList(
            [Block(config, use_sdpa=_use_sdpa(config, i)) for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)  # not weight-tied
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} > block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(**overrides):
    """A freshly initialised TinyGPT; keyword arguments override ``GPTConfig`` fields
    (e.g. ``build_model(n_layer=4)``). The seed is fixed so every call gives identical weights."""
    config = replace(GPTConfig(), **overrides)
    torch.manual_seed(SEED)
    return TinyGPT(config)


def loss_fn(output, batch):
    """Cross-entropy of logits [B, T, V] against batch[1] (targets [B, T])."""
    _, targets = batch
    return F.cross_entropy(output.reshape(-1, output.size(-1)).float(), targets.reshape(-1))


def sample_batch():
    """Deterministic ``(idx, targets)``, int64 [4, 32] each; targets = idx shifted left by one."""
    cfg = GPTConfig()
    g = torch.Generator().manual_seed(1234)
    seq = torch.randint(0, cfg.vocab_size, (BATCH_SIZE, cfg.block_size + 1), generator=g)
    return (seq[:, :-1].contiguous(), seq[:, 1:].contiguous())
