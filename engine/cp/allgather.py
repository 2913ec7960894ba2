"""All-gather context parallelism: every rank gathers the whole K/V, keeps its own queries.

Llama 3 (Grattafiori et al., "The Llama 3 herd of models", 2024, section 3.3.2) trains long
context this way: each of ``N`` ranks holds ``S/N`` tokens (zig-zag, for the causal balance);
attention all-gathers K and V (small under grouped-query attention: 8 KV heads of 128 against
4096 hidden) and computes its own queries against the whole sequence. PyTorch's
``torch.distributed.tensor.experimental.context_parallel`` does the same by default
(``set_rotate_method("allgather")``, the default; ``"alltoall"`` rotates K/V round a ring).

* **Forward**: one all-gather of this rank's ``[K; V]``: ``2 (N-1) (S/N) kv_hidden`` elements
  sent per rank, exactly the ring's forward bytes, but in one collective that the attention
  must wait for (the ring overlaps each step's transfer with the previous block).
* **Backward**: K/V gathered again (not kept from forward, so a rank holds the whole K/V only
  inside its own layer), then dK/dV for the whole sequence, computed from this rank's queries,
  are **reduce-scattered**: each rank receives the sum, over the ranks, of its own tokens'
  gradients. Twice the forward's bytes, as the ring (:func:`engine.theory.allgather_cp_bytes`).
* **Memory**: the whole K/V, ``2 S kv_hidden`` values, and in backward also dK/dV for the whole
  sequence in the accumulation dtype (:func:`engine.theory.cp_memory_bytes`): ``N`` times the
  ring's two blocks, which is why it pays only when K/V is small next to the queries.

The arithmetic is the ring's own block kernels (:mod:`engine.cp.blocks`) and causal schedule
(:func:`engine.cp.ring.block_pairs`), run against every rank's block at once; any layout works.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from engine.comm import ops
from engine.observe.meter import comm_purpose
from engine.cp.blocks import accumulation_dtype, block_backward, block_forward, merge
from engine.cp.buffers import hold
from engine.cp.checks import check_attention_inputs, check_same_on_every_rank
from engine.cp.layout import LAYOUTS, check_sequence_split, chunks_per_rank
from engine.cp.ring import block_pairs
from engine.validation import one_of


def _gather_kv(k, v, group):
    """``(N, 2, b, kv_heads, S/N, d)``: every rank's ``[K; V]``, in rank order."""
    n = dist.get_world_size(group)
    mine = torch.stack([k, v]).contiguous()
    everyone = torch.empty((n, *mine.shape), dtype=mine.dtype, device=mine.device)
    if n == 1:
        everyone[0].copy_(mine)
    else:  # context-parallel traffic, though with dp = 1 the group is dp x cp's ranks
        with comm_purpose("cp"):
            ops.all_gather_into_tensor(everyone.view(-1), mine.view(-1), group=group)
    return everyone


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout):
        me, n = dist.get_rank(group), dist.get_world_size(group)
        per_rank, acc = chunks_per_rank(layout), accumulation_dtype(q.dtype)
        scale = 1 / math.sqrt(q.shape[-1])
        everyone = _gather_kv(k, v, group)
        hold("forward", everyone)
        q_chunks = q.to(acc).chunk(per_rank, dim=-2)
        outs = [torch.zeros_like(c) for c in q_chunks]
        lses = [torch.full(c.shape[:-1], float("-inf"), dtype=acc, device=q.device)
                for c in q_chunks]
        for src in [me] + [r for r in range(n) if r != me]:  # own block first: finite lse
            k_chunks, v_chunks = (t.to(acc).chunk(per_rank, dim=-2) for t in everyone[src])
            for a, b, kind in block_pairs(me, src, n, layout, causal):
                block = block_forward(q_chunks[a], k_chunks[b], v_chunks[b], scale, kind)
                outs[a], lses[a] = merge(outs[a], lses[a], *block)
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.layout = group, causal, layout
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, layout = ctx.group, ctx.causal, ctx.layout
        me, n = dist.get_rank(group), dist.get_world_size(group)
        per_rank, acc = chunks_per_rank(layout), accumulation_dtype(q.dtype)
        scale = 1 / math.sqrt(q.shape[-1])
        dout = dout.to(acc)
        delta = (dout * out).sum(-1)
        q_chunks, lse_chunks = q.to(acc).chunk(per_rank, -2), lse.chunk(per_rank, -1)
        dout_chunks, delta_chunks = dout.chunk(per_rank, -2), delta.chunk(per_rank, -1)
        dq = [torch.zeros_like(c) for c in q_chunks]
        everyone = _gather_kv(k, v, group)  # gathered again: not kept between the passes
        d_everyone = torch.zeros(everyone.shape, dtype=acc, device=q.device)
        for src in range(n):
            k_chunks, v_chunks = (t.to(acc).chunk(per_rank, dim=-2) for t in everyone[src])
            dk_chunks, dv_chunks = (t.chunk(per_rank, dim=-2) for t in d_everyone[src])
            for a, b, kind in block_pairs(me, src, n, layout, causal):
                dq_ab, dk_ab, dv_ab = block_backward(
                    q_chunks[a], k_chunks[b], v_chunks[b], lse_chunks[a], dout_chunks[a],
                    delta_chunks[a], scale, kind)
                dq[a] += dq_ab
                dk_chunks[b].add_(dk_ab)
                dv_chunks[b].add_(dv_ab)
        sending = d_everyone.to(k.dtype)
        mine = torch.empty(sending.shape[1:], dtype=k.dtype, device=k.device)
        hold("backward", everyone, d_everyone, *([sending] if sending is not d_everyone else []),
             mine)
        if n == 1:
            mine.copy_(sending[0])
        else:
            with comm_purpose("cp"):
                ops.reduce_scatter_tensor(mine.view(-1), sending.view(-1), group=group)
        return torch.cat(dq, dim=-2).to(q.dtype), mine[0], mine[1], None, None, None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                        causal: bool = True, layout: str = "zigzag", check: bool = True
                        ) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, K/V all-gathered: exactly
    ``scaled_dot_product_attention`` on the gathered sequence (this rank's rows of it). Same
    arguments as :func:`engine.cp.ring_attention`."""
    one_of("layout", layout, LAYOUTS)
    check_attention_inputs(q, k, v, "allgather_attention")
    n = dist.get_world_size(group)
    if layout == "zigzag" and q.shape[-2] % 2:
        raise ValueError(f"allgather_attention: a zig-zag shard holds 2 equal chunks, but this "
                         f"rank holds {q.shape[-2]} tokens")
    if check:
        check_same_on_every_rank(q, k, group, "allgather_attention")
        check_sequence_split(n * q.shape[-2], n, layout)
    return _AllGatherAttention.apply(q, k, v, group, causal, layout)
