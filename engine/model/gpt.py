"""The engine's one GPT, in a file you can read at once.

:class:`GPT` is nanoGPT's layout (Radford et al. 2019, GPT-2: pre-LayerNorm blocks, causal
self-attention, a GELU MLP, learned positions) with the three choices 2026 models make:
grouped-query attention (Ainslie et al. 2023), dense or mixture-of-experts feed-forward layers
(the MoE layer is given from above: :mod:`engine.moe`), tied or untied embeddings. Four more
choices give Llama 3's architecture (Grattafiori et al., "The Llama 3 Herd of Models", 2024):
RMSNorm (:mod:`engine.model.rmsnorm`), rotary positions (:mod:`engine.model.rope`), a SwiGLU
MLP (Shazeer, "GLU Variants Improve Transformer", 2020, eq. 6: ``out(silu(x W) * (x V))``,
``[W | V]`` one linear layer ``gate_up`` as Megatron-LM fuses it) and no biases.
:class:`TinyGPT` is its name in the chapters. Every constructor takes a ``seed``: the same seed
gives bit-identical weights on every rank and in the single-process reference, which is what
the equivalence tests compare against. Every parallel layout changes its modules from outside
(:mod:`engine.compose.parallelize`); none defines another GPT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.utils.checkpoint
import torch.nn as nn
import torch.nn.functional as F

from engine.model.attention import causal_attention, fast_causal_attention
from engine.model.rmsnorm import RMSNorm
from engine.model.rope import rotate
from engine.model.seed import seeded
from engine.validation import non_negative_int, one_of, positive_int, positive_number


@dataclass(frozen=True)
class GPTConfig:
    """The sizes of a GPT and its choices, each default GPT-2's: ``kv_heads`` (grouped-query
    attention; 0: as many as the query heads), ``tied`` (the output layer shares the input
    embedding's weight), ``qkv_bias`` (False: Llama's q, k, v without bias), ``ffn_hidden``
    (the MLP's width; 0: ``4 hidden``); Llama 3's: ``norm="rmsnorm"``, ``mlp="swiglu"``,
    ``positions="rope"`` (rotated by ``rope_theta``; no position embedding) and ``bias=False``
    (no bias in the output projection and the MLP either); ``attention="fast"``: the fused
    kernel, where ``"written"`` is the equation a learner reads."""

    vocab: int = 64
    seq_len: int = 16
    layers: int = 2
    heads: int = 2
    hidden: int = 32
    kv_heads: int = 0
    tied: bool = True
    qkv_bias: bool = True
    ffn_hidden: int = 0
    norm: str = "layernorm"  # or "rmsnorm"
    mlp: str = "gelu"  # or "swiglu"
    positions: str = "learned"  # or "rope"
    rope_theta: float = 10_000.0  # RoFormer's; Llama 3's is 500,000
    bias: bool = True
    attention: str = "written"  # or "fast": PyTorch's fused kernel (engine.model.attention)

    def __post_init__(self):
        name = type(self).__name__
        for size in ("vocab", "seq_len", "layers", "heads", "hidden"):
            positive_int(f"{name}.{size}", getattr(self, size))
        for size in ("kv_heads", "ffn_hidden"):
            non_negative_int(f"{name}.{size}", getattr(self, size))
        if self.hidden % self.heads:
            raise ValueError(f"{name}.hidden={self.hidden} must be divisible by "
                             f"heads={self.heads}")
        one_of(f"{name}.norm", self.norm, ("layernorm", "rmsnorm"))
        one_of(f"{name}.mlp", self.mlp, ("gelu", "swiglu"))
        one_of(f"{name}.positions", self.positions, ("learned", "rope"))
        one_of(f"{name}.attention", self.attention, ("written", "fast"))
        positive_number(f"{name}.rope_theta", self.rope_theta)
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"{name}: rotary positions turn pairs of features, so head_dim ="
                             f" hidden / heads = {self.head_dim} must be even")
        if self.heads % self.kv_heads_or_heads:
            raise ValueError(f"{name}.kv_heads={self.kv_heads} must divide heads={self.heads}:"
                             " each KV head serves a group of query heads")

    @property
    def kv_heads_or_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def make_norm(self) -> nn.Module:
        return RMSNorm(self.hidden) if self.norm == "rmsnorm" else nn.LayerNorm(self.hidden)


def grouped_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                             ) -> torch.Tensor:
    """:func:`engine.model.attention.causal_attention` with each KV head repeated for its group of
    query heads. ``q``: ``(b, heads, s, d)``; ``k``, ``v``: ``(b, kv_heads, s, d)``."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    return causal_attention(q, k, v)


class Attention(nn.Module):
    """Causal grouped-query self-attention (Ainslie et al., "GQA", 2023): ``heads`` query
    heads share ``kv_heads`` key/value heads (``kv_heads = heads``: multi-head attention, as
    GPT-2; 1: multi-query). One fused projection ``[q | k | v]`` of ``heads + 2 kv_heads``
    heads, then ``core(q, k, v)``, then the output projection.

    ``heads`` and ``kv_heads`` are this module's (a tensor-parallel rank holds ``1/t`` of
    each); ``core`` is the attention itself: :func:`grouped_causal_attention`, or ring /
    Ulysses attention over a context-parallel group (:mod:`engine.cp`), set from outside.
    With rotary positions (``rope_theta`` > 0) q and k are rotated by the tokens' global
    ``positions`` before ``core`` sees them (:func:`engine.model.rope.rotate`)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads_or_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden, (self.heads + 2 * self.kv_heads) * self.head_dim,
                             bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.rope_theta = cfg.rope_theta if cfg.positions == "rope" else 0.0
        self.core = fast_causal_attention if cfg.attention == "fast" else \
            grouped_causal_attention

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.qkv(x)  # with sequence parallelism x holds s/t tokens, qkv all s
        b, s, _ = qkv.shape
        d = self.head_dim
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v))
        if self.rope_theta:
            if positions is None:
                positions = torch.arange(s, device=x.device)
            q, k = rotate(q, positions, self.rope_theta), rotate(k, positions, self.rope_theta)
        y = self.core(q, k, v).transpose(1, 2).reshape(b, s, self.heads * d)
        return self.proj(y)


CausalSelfAttention = Attention  # its name before grouped-query attention


class Block(nn.Module):
    """A pre-norm block: ``x + attn(ln1(x))``, then ``x + ffn(ln2(x))``, where the
    feed-forward layer is the MLP ``out(gelu(fc(.)))`` (SwiGLU: ``out(silu(gate) * up)``,
    ``[gate | up] = gate_up(.)``) or, once one is set, ``moe`` (a mixture of experts,
    :class:`engine.moe.MoE`).
    ``ln1`` and ``ln2`` are LayerNorms or RMSNorms (``cfg.norm``)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = cfg.make_norm()
        self.attn = Attention(cfg)
        self.ln2 = cfg.make_norm()
        if cfg.mlp == "swiglu":  # one linear layer, one input: tensor parallelism gathers
            self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.ffn, bias=cfg.bias)  # it once
        else:
            self.fc = nn.Linear(cfg.hidden, cfg.ffn, bias=cfg.bias)
        self.out = nn.Linear(cfg.ffn, cfg.hidden, bias=cfg.bias)
        self.moe: nn.Module | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), positions)
        h = self.ln2(x)
        return x + (self.moe(h) if self.moe is not None else self.mlp(h))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up"):
            gate, up = self.gate_up(h).chunk(2, dim=-1)
            return self.out(F.silu(gate) * up)
        return self.out(F.gelu(self.fc(h)))


def gpt2_init(module: nn.Module) -> None:
    """GPT-2's initialisation (Radford et al. 2019, as in nanoGPT): every linear and embedding
    weight N(0, 0.02), every linear bias zero, so the first loss is about ln(vocab). Use it as
    ``model.apply(gpt2_init)``."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class GPT(nn.Module):
    """The one GPT: ``forward(idx, positions=None)`` returns the logits ``[batch, seq, vocab]``
    of the tokens ``idx`` at ``positions`` (default ``0 .. seq - 1``).

    The parallel layouts change its modules, not this class: tensor parallelism replaces the
    linear layers, the embedding and the LayerNorms (and sets ``sp_group`` under sequence
    parallelism), context parallelism sets each attention's ``core`` and passes the positions
    its rank holds, a pipeline stage keeps some blocks (``tok = None``: it takes a hidden
    state; ``head = None``: it returns one). The pieces :meth:`embed`, :meth:`run_blocks` and
    :meth:`output` are what a pipeline chunk runs.

    ``feed_forward``: a mixture-of-experts model. Called once, under the seed ``seed + 1``,
    with the number of blocks, it returns one layer per block (each ``hidden -> hidden``),
    which replaces that block's MLP as ``block.moe`` (:func:`engine.moe.gpt.moe_feed_forward`,
    given by :class:`engine.compose.model.GPT`); this foundation layer never imports the MoE
    layer.

    ``checkpoint=True`` recomputes each block's forward during backward instead of keeping its
    activations (activation checkpointing, Chen et al., "Training deep nets with sublinear
    memory cost", 2016; ``torch.utils.checkpoint``): only the block inputs are kept, at the
    price of one more forward pass per block.
    """

    def __init__(self, cfg: GPTConfig = GPTConfig(), seed: int = 0, checkpoint: bool = False,
                 feed_forward: Callable[[int], Sequence[nn.Module]] | None = None):
        super().__init__()
        self.cfg, self.checkpoint = cfg, checkpoint
        self.sp_group = None  # the tensor-parallel group under sequence parallelism
        with seeded(seed):
            self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
            # learned positions, or none: rotary ones live in the attention (engine.model.rope)
            self.pos = nn.Embedding(cfg.seq_len, cfg.hidden) if cfg.positions == "learned" \
                else None
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
            self.ln_f = cfg.make_norm()
            self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
            self.apply(gpt2_init)
        if cfg.tied:
            self.head.weight = self.tok.weight  # as in GPT-2
        if feed_forward is not None:
            with seeded(seed + 1):
                layers = list(feed_forward(len(self.blocks)))
            if len(layers) != len(self.blocks):
                raise ValueError(f"feed_forward gave {len(layers)} layers; expected one per "
                                 f"block, {len(self.blocks)}")
            for block, layer in zip(self.blocks, layers):
                block.moe = layer
                for name in ("fc", "gate_up", "out"):
                    if hasattr(block, name):
                        delattr(block, name)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = idx if self.tok is None else self.embed(idx, positions)  # None: a later stage
        x = self.run_blocks(x, 0, len(self.blocks), positions)
        return x if self.head is None else self.output(x)

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The token and position embeddings of ``idx`` at ``positions`` (rotary positions:
        the token embeddings alone)."""
        if positions is None:
            s = idx.shape[1]
            if s > self.cfg.seq_len:
                raise ValueError(f"sequence length {s} exceeds {type(self.cfg).__name__}."
                                 f"seq_len={self.cfg.seq_len}")
            positions = torch.arange(s, device=idx.device)
        if self.pos is None:
            return self.tok(idx)
        pos = self.pos(positions)
        if self.sp_group is not None:  # this rank's s/t positions, as its tokens
            pos = self.scatter_positions(pos, self.sp_group)
        return self.tok(idx) + pos

    def scatter_positions(self, pos: torch.Tensor, group) -> torch.Tensor:
        """This rank's ``s/t`` rows of ``pos`` under sequence parallelism. Tensor parallelism
        lives above this layer: :class:`engine.compose.model.GPT` gives it."""
        raise NotImplementedError(f"sp_group={group!r} is set, but {type(self).__name__} "
                                  "cannot scatter positions: use engine.compose.model.GPT")

    def run_blocks(self, x: torch.Tensor, start: int, end: int,
                   positions: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks ``start`` to ``end - 1`` on the hidden state ``x`` (a pipeline chunk), its
        tokens at ``positions`` (default ``0 .. seq - 1``; rotary positions need them)."""
        for block in self.blocks[start:end]:
            if self.checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, positions, use_reentrant=False)
            else:
                x = block(x, positions)
        return x

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The logits of the hidden state ``x``."""
        return self.head(self.ln_f(x))

    def moe_layers(self) -> list[nn.Module]:
        """The mixture-of-experts layers of the blocks this model holds (none: dense)."""
        return [b.moe for b in self.blocks if getattr(b, "moe", None) is not None]

    def router_losses(self, start: int = 0, end: int | None = None) -> torch.Tensor | float:
        """Every MoE layer's balancing loss and z-loss from the last forward (0: dense), of
        blocks ``start`` to ``end - 1`` (default: all)."""
        moes = [getattr(b, "moe", None) for b in self.blocks[start:end]]  # other pipeline
        return sum((m.aux_loss + m.z_loss for m in moes  # stages' blocks: nn.Identity
                    if getattr(m, "aux_loss", None) is not None), 0.0)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        """The mean cross-entropy of the next-token predictions, plus the router losses of an
        MoE model."""
        logits = self(idx, positions)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return loss + self.router_losses() if self.moe_layers() else loss


class TinyGPT(GPT):
    """The name every chapter uses: :class:`GPT`, by default GPT-2's shape (multi-head
    attention, a 4x MLP, tied embeddings) at :class:`GPTConfig`'s small sizes."""
