"""``GPT``: the one GPT definition the composed engine parallelises.

nanoGPT's layout (Radford et al. 2019: pre-LayerNorm blocks, causal self-attention, GELU
feed-forward, learned positions), with the three choices 2026 models make:

* **grouped-query attention** (Ainslie et al., "GQA", 2023): ``heads`` query heads share
  ``kv_heads`` key/value heads (``kv_heads = heads``: multi-head attention; 1: multi-query).
  The fused projection is ``[q | k | v]`` of ``heads + 2 kv_heads`` heads.
* **dense or mixture-of-experts feed-forward layers** (``num_experts > 0``: every block's MLP
  is an :class:`engine.moe.MoE`, as in :class:`engine.moe.gpt.TinyMoEGPT`; with Switch's
  balancing loss, ST-MoE's z-loss and optionally DeepSeek-V3's aux-loss-free bias);
* **tied or untied** input embedding and output layer.

With ``kv_heads = heads``, ``tied=True`` and no experts, ``GPT(cfg, seed)`` has the same
parameters, names and bits as :class:`engine.models.TinyGPT` (tests/test_compose.py).

The forward takes the token ids *and their positions* in the sequence: a context-parallel rank
holds tokens from several places of it (:mod:`engine.cp.layout`), so the data layer, which cut
them, says where they are. The parallel layouts change modules, not this file:
:func:`engine.compose.parallelize.parallelize` replaces the linear layers, the embedding and
the LayerNorms by their tensor-parallel forms, sets each attention's ``core`` (ring or Ulysses
under context parallelism) and, with sequence parallelism, ``sp_group``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import causal_attention
from engine.models import GPTConfig, gpt2_init, seeded
from engine.moe.layer import MoE
from engine.tp.mappings import scatter_to_sequence_parallel
from engine.validation import non_negative_int, positive_int


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 64
    seq_len: int = 16
    layers: int = 2
    heads: int = 4
    hidden: int = 32
    kv_heads: int = 0  # 0: as many as the query heads
    tied: bool = True
    qkv_bias: bool = True  # False: no bias in q, k, v (Llama's choice; see engine.compose.parity)
    num_experts: int = 0  # 0: dense feed-forward layers
    top_k: int = 2
    capacity_factor: float = 1.25
    # Switch's load-balancing loss and ST-MoE's router z-loss, each over the global
    # micro-batch under a parallel layout (engine.compose.experts.balance_globally)
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 1e-3
    bias_update_rate: float | None = None  # DeepSeek-V3's aux-loss-free bias (gamma)
    ffn_hidden: int = 0  # 0: 4 x hidden

    def __post_init__(self):
        for name in ("vocab", "seq_len", "layers", "heads", "hidden", "top_k"):
            positive_int(f"ModelConfig.{name}", getattr(self, name))
        for name in ("kv_heads", "num_experts", "ffn_hidden"):
            non_negative_int(f"ModelConfig.{name}", getattr(self, name))
        if self.hidden % self.heads:
            raise ValueError(f"ModelConfig.hidden = {self.hidden} must be divisible by heads = "
                             f"{self.heads}")
        if self.heads % self.kv_heads_or_heads:
            raise ValueError(f"ModelConfig.kv_heads = {self.kv_heads} must divide heads = "
                             f"{self.heads}: each KV head serves a group of query heads")

    @property
    def kv_heads_or_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def from_gpt(cls, cfg: GPTConfig, **choices) -> "ModelConfig":
        """The :class:`engine.models.GPTConfig` sizes, with the choices above."""
        return cls(vocab=cfg.vocab, seq_len=cfg.seq_len, layers=cfg.layers, heads=cfg.heads,
                   hidden=cfg.hidden, **choices)


def grouped_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                             ) -> torch.Tensor:
    """:func:`engine.attention.causal_attention` with each KV head repeated for its group of
    query heads. ``q``: ``(b, heads, s, d)``; ``k``, ``v``: ``(b, kv_heads, s, d)``."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    return causal_attention(q, k, v)


class Attention(nn.Module):
    """Causal grouped-query self-attention. ``heads`` and ``kv_heads`` are this module's
    (a tensor-parallel rank holds ``1/t`` of each); ``core(q, k, v)`` is the attention itself:
    :func:`grouped_causal_attention`, or ring / Ulysses attention over a context group."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads_or_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden, (self.heads + 2 * self.kv_heads) * self.head_dim,
                             bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.core = grouped_causal_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # with sequence parallelism x holds s/t tokens, qkv all s
        b, s, _ = qkv.shape
        d = self.head_dim
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v))
        y = self.core(q, k, v).transpose(1, 2).reshape(b, s, self.heads * d)
        return self.proj(y)


class Block(nn.Module):
    """``x + attn(ln1(x))``, then ``x + ffn(ln2(x))``: the MLP ``out(gelu(fc(.)))`` or an
    MoE layer ``moe``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc = nn.Linear(cfg.hidden, cfg.ffn)
        self.out = nn.Linear(cfg.ffn, cfg.hidden)
        self.moe: MoE | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        return x + (self.moe(h) if self.moe is not None else self.out(F.gelu(self.fc(h))))


class GPT(nn.Module):
    """``forward(idx, positions)``: logits ``[batch, seq, vocab]`` (under tensor
    parallelism, this rank's ``vocab / t`` of them) of the tokens ``idx`` at ``positions``.
    A pipeline stage without the embedding (``tok = None``) takes a hidden state instead, and
    one without the output layer (``head = None``) returns its hidden state.

    ``expert_group``: the group the MoE layers are built over (:class:`engine.moe.MoE`'s
    ``group``). Inside launched ranks pass a one-rank group
    (:func:`engine.moe.layer.single_rank_group`): every rank then builds every expert, from the
    same seed, and expert parallelism keeps its share (:mod:`engine.compose.experts`)."""

    def __init__(self, cfg: ModelConfig = ModelConfig(), seed: int = 0, expert_group=None):
        super().__init__()
        self.cfg = cfg
        self.sp_group = None  # the tensor-parallel group under sequence parallelism
        with seeded(seed):
            self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
            self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
            self.ln_f = nn.LayerNorm(cfg.hidden)
            self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
            self.apply(gpt2_init)
        if cfg.tied:
            self.head.weight = self.tok.weight  # as in GPT-2
        if cfg.num_experts:
            with seeded(seed + 1):  # as engine.moe.gpt.TinyMoEGPT draws its experts
                for block in self.blocks:
                    block.moe = MoE(cfg.hidden, cfg.ffn, cfg.num_experts, cfg.top_k,
                                    cfg.capacity_factor, expert_group, cfg.aux_loss_coef,
                                    cfg.z_loss_coef, bias_update_rate=cfg.bias_update_rate)
                    block.moe.apply(gpt2_init)
                    del block.fc, block.out

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = idx if self.tok is None else self.embed(idx, positions)  # None: a later stage
        x = self.run_blocks(x, 0, len(self.blocks))
        return x if self.head is None else self.output(x)

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The token and position embeddings of ``idx`` at ``positions``."""
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        pos = self.pos(positions)
        if self.sp_group is not None:  # this rank's s/t positions, as its tokens
            pos = scatter_to_sequence_parallel(pos, self.sp_group, dim=0)
        return self.tok(idx) + pos

    def run_blocks(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Blocks ``start`` to ``end - 1`` on the hidden state ``x`` (a pipeline chunk)."""
        for block in self.blocks[start:end]:
            x = block(x)
        return x

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The logits of the hidden state ``x``."""
        return self.head(self.ln_f(x))

    def router_losses(self, start: int = 0, end: int | None = None) -> torch.Tensor | float:
        """Every MoE layer's balancing loss and z-loss from the last forward (0: dense), of
        blocks ``start`` to ``end - 1`` (default: all)."""
        moes = [getattr(b, "moe", None) for b in self.blocks[start:end]]  # other pipeline
        return sum((m.aux_loss + m.z_loss for m in moes  # stages' blocks: nn.Identity
                    if m is not None and m.aux_loss is not None), 0.0)
