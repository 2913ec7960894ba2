"""Small deterministic models and synthetic data for every chapter.

Every constructor takes a ``seed``: the same seed gives bit-identical weights on every rank and
in the single-process reference, which is what the equivalence tests compare against.
``TinyGPT`` follows nanoGPT's layout (Radford et al. 2019, GPT-2: pre-LayerNorm blocks, causal
self-attention, a 4x MLP with GELU, tied input/output embeddings) in a file you can read at
once.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
import torch.nn as nn
import torch.nn.functional as F

from engine.attention import causal_attention
from engine.validation import positive_int


@contextlib.contextmanager
def seeded(seed: int):
    """Run a block with the global RNG seeded, leaving the caller's RNG state untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class MLP(nn.Module):
    """``sizes=(8, 32, 4)`` gives Linear(8,32) -> GELU -> Linear(32,4)."""

    def __init__(self, sizes=(16, 64, 64, 8), seed: int = 0):
        super().__init__()
        if len(sizes) < 2 or any(int(s) < 1 for s in sizes):
            raise ValueError(f"sizes must list >= 2 positive layer widths, got {sizes!r}")
        layers: list[nn.Module] = []
        with seeded(seed):
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
                layers.append(nn.Linear(a, b))
                if i < len(sizes) - 2:
                    layers.append(nn.GELU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    seq_len: int = 16
    layers: int = 2
    heads: int = 2
    hidden: int = 32

    def __post_init__(self):
        for name in ("vocab", "seq_len", "layers", "heads", "hidden"):
            positive_int(f"GPTConfig.{name}", getattr(self, name))
        if self.hidden % self.heads:
            raise ValueError(
                f"GPTConfig.hidden={self.hidden} must be divisible by heads={self.heads}"
            )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused q/k/v projection, then
    :func:`engine.attention.causal_attention` on every head, then the output projection."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = causal_attention(q, k, v).transpose(1, 2).reshape(b, s, h)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.out = nn.Linear(4 * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def gpt2_init(module: nn.Module) -> None:
    """GPT-2's initialisation (Radford et al. 2019, as in nanoGPT): every linear and embedding
    weight N(0, 0.02), every linear bias zero, so the first loss is about ln(vocab). Use it as
    ``model.apply(gpt2_init)``."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class TinyGPT(nn.Module):
    """A GPT-2-shaped decoder; ``forward(idx)`` returns logits ``[batch, seq, vocab]``.

    ``checkpoint=True`` recomputes each block's forward during backward instead of keeping its
    activations (activation checkpointing, Chen et al., "Training deep nets with sublinear
    memory cost", 2016; ``torch.utils.checkpoint``): only the block inputs are kept, at the
    price of one more forward pass per block.
    """

    def __init__(self, cfg: GPTConfig = GPTConfig(), seed: int = 0, checkpoint: bool = False):
        super().__init__()
        self.cfg, self.checkpoint = cfg, checkpoint
        with seeded(seed):
            self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
            self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
            self.ln_f = nn.LayerNorm(cfg.hidden)
            self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
            self.apply(gpt2_init)
        self.head.weight = self.tok.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, s = idx.shape
        if s > self.cfg.seq_len:
            raise ValueError(f"sequence length {s} exceeds GPTConfig.seq_len={self.cfg.seq_len}")
        x = self.tok(idx) + self.pos(torch.arange(s, device=idx.device))
        for block in self.blocks:
            if self.checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def regression_data(
    n: int, d_in: int, d_out: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples of a fixed random linear map plus noise: ``(x [n, d_in], y [n, d_out])``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g) / math.sqrt(d_in)
    y = x @ w + 0.01 * torch.randn(n, d_out, generator=g)
    return x, y


def token_data(
    batch: int, seq_len: int, vocab: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and their next-token targets: ``(idx, targets)``, each ``[batch, seq]``."""
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(vocab, (batch, seq_len + 1), generator=g)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def shard(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous slice of a global batch (data parallelism splits it this way)."""
    if batch.size(0) % world_size:
        raise ValueError(
            f"global batch of {batch.size(0)} does not split evenly over {world_size} ranks"
        )
    per = batch.size(0) // world_size
    return batch[rank * per : (rank + 1) * per]
