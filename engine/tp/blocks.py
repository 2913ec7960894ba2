"""Tensor-parallel transformer pieces for :class:`engine.model.gpt.TinyGPT`.

Per layer (Megatron-LM, section 3, Figure 3): the MLP is column-parallel ``fc`` (each rank
4h/t of the hidden units), a local GeLU, then row-parallel ``out``; attention splits the
heads (each rank a/t heads: its slice of q, k and v is column-parallel, the output projection
row-parallel). Each costs one all-reduce forward (g) and one backward (f): **2 + 2 per
layer**, each of b*s*h elements. LayerNorms and the position embedding are replicated.

``sequence_parallel=True`` (Korthikanti et al., MLSys 2023, section 4.2.2): between the
parallel blocks each rank holds ``s/t`` tokens, so the LayerNorms (and dropout, where a model
has it) run on ``s/t`` tokens and their activations shrink by ``t``. Each all-reduce becomes a
reduce-scatter (leaving a block) and an all-gather (entering the next): the same bytes, plus
one all-gather per column-parallel layer in backward (:func:`engine.tp.mappings.
gathered_linear`): ``10 bsh (t-1)/t`` per layer (:func:`engine.theory.
sp_comm_elements_per_layer`), and the sequence length must divide by ``t``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention import causal_attention
from engine.tp.layers import (ColumnParallelLinear, RowParallelLinear,
                              SequenceParallelLayerNorm, VocabParallelEmbedding, check_divisible,
                              tp_rank_and_size, vocab_parallel_cross_entropy)
from engine.tp.mappings import (check_sequence_split, copy_to_tp, gather_from_tp,
                                gathered_linear, scatter_to_sequence_parallel)
from engine.tp.layout import HEADS, dense_block_name, heads_joined, heads_slice, split_dim
from engine.validation import positive_int


class ParallelMLP(nn.Module):
    def __init__(self, fc: ColumnParallelLinear, out: RowParallelLinear):
        super().__init__()
        self.fc, self.out = fc, out

    @classmethod
    def from_dense(cls, fc: nn.Linear, out: nn.Linear, group=None,
                   sequence_parallel: bool = False):
        return cls(ColumnParallelLinear.from_dense(fc, group, gather_output=False,
                                                   sequence_parallel=sequence_parallel),
                   RowParallelLinear.from_dense(out, group, input_is_parallel=True,
                                                sequence_parallel=sequence_parallel))

    def forward(self, x):
        return self.out(F.gelu(self.fc(x)))


class ParallelAttention(nn.Module):
    """Causal self-attention with ``heads / t`` heads on each rank."""

    def __init__(self, qkv: ColumnParallelLinear, proj: RowParallelLinear, local_heads: int):
        super().__init__()
        self.qkv, self.proj, self.local_heads = qkv, proj, local_heads

    @classmethod
    def from_dense(cls, attn: nn.Module, group=None, sequence_parallel: bool = False):
        rank, t = tp_rank_and_size(group)
        local_heads = check_divisible("heads", attn.heads, t)
        hidden = attn.proj.in_features
        qkv = ColumnParallelLinear(hidden, 3 * hidden, gather_output=False, group=group,
                                   device=attn.qkv.weight.device, dtype=attn.qkv.weight.dtype,
                                   sequence_parallel=sequence_parallel)
        with torch.no_grad():  # rank r's heads of q, of k and of v, side by side
            qkv.weight.copy_(heads_slice(attn.qkv.weight, t, rank))
            qkv.bias.copy_(heads_slice(attn.qkv.bias, t, rank))
        proj = RowParallelLinear.from_dense(attn.proj, group, input_is_parallel=True,
                                            sequence_parallel=sequence_parallel)
        return cls(qkv, proj, local_heads)

    def forward(self, x):
        qkv = self.qkv(x)  # with sequence parallelism x holds s/t tokens, qkv all s
        b, s, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=-1)
        d = q.shape[-1] // self.local_heads
        q, k, v = (t.view(b, s, self.local_heads, d).transpose(1, 2) for t in (q, k, v))
        y = causal_attention(q, k, v).transpose(1, 2).reshape(b, s, self.local_heads * d)
        return self.proj(y)


class ParallelBlock(nn.Module):
    def __init__(self, block: nn.Module, group=None, sequence_parallel: bool = False):
        super().__init__()
        if sequence_parallel:
            self.ln1, self.ln2 = (SequenceParallelLayerNorm.from_dense(ln, group)
                                  for ln in (block.ln1, block.ln2))
        else:
            self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn = ParallelAttention.from_dense(block.attn, group, sequence_parallel)
        self.mlp = ParallelMLP.from_dense(block.fc, block.out, group, sequence_parallel)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


COMPOSED = "use engine.compose's parallelize, which splits every GPT the engine builds"


def check_tp_degree(cfg, t: int) -> None:
    """Raise a clear error, naming the value and what was expected, if :class:`TensorParallelGPT`
    cannot split ``cfg`` (a :class:`engine.model.gpt.GPTConfig`, or a
    :class:`engine.compose.model.ModelConfig`) ``t`` ways. Pure: call it before any rank starts.

    This readable layer splits GPT-2's shape only: multi-head attention (``kv_heads`` 0 or
    ``heads``), a biased fused ``qkv``, the output layer tied to the embedding, dense MLPs.
    The MLP's width (``ffn_hidden``) may be any multiple of ``t``."""
    positive_int("the tensor-parallel degree", t)
    if not cfg.tied:
        raise ValueError(f"TensorParallelGPT splits tied models only; got tied={cfg.tied}: "
                         f"{COMPOSED}")
    if cfg.kv_heads_or_heads != cfg.heads:
        raise ValueError(f"TensorParallelGPT splits multi-head attention only (kv_heads 0 or "
                         f"heads={cfg.heads}); got kv_heads={cfg.kv_heads}: {COMPOSED}")
    if not cfg.qkv_bias:
        raise ValueError(f"TensorParallelGPT splits a qkv with a bias only; got "
                         f"qkv_bias={cfg.qkv_bias}: {COMPOSED}")
    check_dense_feed_forward(getattr(cfg, "num_experts", 0))
    check_divisible("hidden", cfg.hidden, t)
    check_divisible("heads", cfg.heads, t)
    check_divisible("ffn_hidden", cfg.ffn, t)
    check_divisible("vocab", cfg.vocab, t)


def check_dense_feed_forward(num_experts: int) -> None:
    """TensorParallelGPT splits dense MLPs, not mixture-of-experts layers."""
    if num_experts:
        raise ValueError(f"TensorParallelGPT splits dense MLPs only; got num_experts="
                         f"{num_experts} (expected 0): {COMPOSED}")


class TensorParallelGPT(nn.Module):
    """A :class:`engine.model.gpt.TinyGPT` split over the tensor-parallel group: vocab-parallel
    embedding (tied to a vocab-parallel output layer), parallel blocks, vocab-parallel loss.
    ``sequence_parallel=True``: the embedding is reduce-scattered along the sequence, every
    LayerNorm runs on ``s/t`` tokens, and the final one's output is gathered for the logits."""

    def __init__(self, gpt: nn.Module, group=None, sequence_parallel: bool = False):
        super().__init__()
        _, t = tp_rank_and_size(group)
        cfg = gpt.cfg
        check_tp_degree(cfg, t)
        check_dense_feed_forward(max((m.num_experts for m in gpt.moe_layers()), default=0))
        self.group, self.cfg, self.sequence_parallel = group, cfg, sequence_parallel
        self.tok = VocabParallelEmbedding.from_dense(gpt.tok, group, sequence_parallel)
        self.pos = copy.deepcopy(gpt.pos)
        self.blocks = nn.ModuleList(ParallelBlock(block, group, sequence_parallel)
                                    for block in gpt.blocks)
        self.ln_f = (SequenceParallelLayerNorm.from_dense(gpt.ln_f, group) if sequence_parallel
                     else copy.deepcopy(gpt.ln_f))

    @classmethod
    def from_dense(cls, gpt: nn.Module, group=None, sequence_parallel: bool = False):
        return cls(gpt, group, sequence_parallel)

    def forward(self, idx: torch.Tensor, gather: bool = False) -> torch.Tensor:
        """Logits for this rank's slice of the vocabulary (``gather=True``: all of them)."""
        s = idx.shape[1]
        pos = self.pos(torch.arange(s, device=idx.device))
        if self.sequence_parallel:
            check_sequence_split(s, tp_rank_and_size(self.group)[1])
            pos = scatter_to_sequence_parallel(pos, self.group, dim=0)
        x = self.tok(idx) + pos
        for block in self.blocks:
            x = block(x)
        if self.sequence_parallel:
            logits = gathered_linear(self.ln_f(x), self.tok.weight, None, self.group)
        else:
            logits = F.linear(copy_to_tp(self.ln_f(x), self.group), self.tok.weight)
        return gather_from_tp(logits, self.group) if gather else logits

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(self(idx), targets, self.group).mean()


def gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's slice ``x`` of a tensor cut on ``dim``, joined in rank order: one
    all-gather over the tensor-parallel ``group``. Not differentiable (for checking and
    saving)."""
    return gather_from_tp(x.detach().movedim(dim, -1).contiguous(), group).movedim(-1, dim)


def gather_parameter(x: torch.Tensor, name: str, group) -> torch.Tensor:
    """The dense parameter ``name`` (or its gradient) from this rank's slice ``x``: gathered
    over ``group`` along the dimension :func:`engine.tp.layout.split_dim` names, or copied
    if it is replicated. Call on every rank of ``group``."""
    split = split_dim(name)
    if split is None:
        return x.detach().clone()
    if split == HEADS:
        _, t = tp_rank_and_size(group)
        return heads_joined(list(gather_dim(x, 0, group).chunk(t, dim=0)))
    return gather_dim(x, split, group)


def block_dense_state(block: ParallelBlock, prefix: str, group, grads: bool = False
                      ) -> dict[str, torch.Tensor]:
    """One :class:`ParallelBlock`'s parameters (or gradients), gathered over the
    tensor-parallel ``group`` and named like the dense block's, under ``prefix``."""
    state = {}
    for name, p in block.named_parameters():
        name = dense_block_name(name)
        state[prefix + name] = gather_parameter(p.grad if grads else p, name, group)
    return state


def dense_state(model: TensorParallelGPT, grads: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's parameters (or their gradients), gathered from every rank and laid
    out like the dense :class:`engine.model.gpt.TinyGPT`'s ``state_dict``. Call on every rank."""
    group = model.group

    def gathered(name, p):
        return gather_parameter(p.grad if grads else p, name, group)

    state = {"tok.weight": gathered("tok.weight", model.tok.weight),
             "pos.weight": gathered("pos.weight", model.pos.weight)}
    for i, block in enumerate(model.blocks):
        state.update(block_dense_state(block, f"blocks.{i}.", group, grads))
    for name, p in model.ln_f.named_parameters():
        state[f"ln_f.{name}"] = gathered(f"ln_f.{name}", p)
    state["head.weight"] = state["tok.weight"]
    return state
