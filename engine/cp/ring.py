"""Ring attention: context parallelism with K/V blocks passed round a ring of ranks.

Liu, Zaharia & Abbeel, "Ring attention with blockwise transformers for near-infinite context"
(2023); the form Megatron-Core's context parallelism runs (its ``cp_comm_type="p2p"``). PyTorch's
``context_parallel`` (which torchtitan calls) all-gathers K/V by default instead
(:mod:`engine.cp.allgather`), and rotates K/V round a ring only when asked to. Each of ``N`` ranks
holds ``S/N`` tokens of q, k and v (:mod:`engine.cp.layout`). In step ``s = 0 .. N-1`` rank
``r`` attends its queries to the K/V block of rank ``r - s`` while already sending that block
on to rank ``r + 1`` (the next step's block arrives during this step's arithmetic), and merges
the result into its running output with the online-softmax rule (:mod:`engine.cp.blocks`).

* **Forward**: N-1 K/V exchanges; each rank sends ``2 (N-1) (S/N) kv_hidden`` elements
  (:func:`engine.theory.ring_attention_bytes`): about ``2 S kv_hidden`` whatever N.
* **Backward**: the K/V blocks go round again, and so does each block's gradient: the dK/dV
  accumulator of rank ``j``'s block starts on rank ``j+1`` at step 1, collects every other
  rank's share, and reaches rank ``j`` after step N-1, where ``j``'s own share is added. N-1
  K/V exchanges and N-1 dK/dV exchanges: twice the forward's bytes.
* **Causal mask at block granularity**: a (query chunk, key chunk) pair is fully visible when
  the key chunk comes earlier, on the diagonal when it is the same chunk, and skipped, never
  computed, when it comes later (:func:`block_pairs`).

Only ``S/N`` queries and two K/V blocks live on a rank at a time: memory grows as ``S/N``
(:func:`engine.theory.cp_memory_bytes` counts the buffers: the K/V block in use and the one
arriving, and in backward the dK/dV share and accumulator in the accumulation dtype).
Arithmetic runs in :func:`engine.cp.blocks.accumulation_dtype` (fp32, or fp64 for fp64 inputs).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from engine.observe.meter import comm_purpose
from engine.comm.ring import exchange, ring_position, start_exchange
from engine.cp.buffers import hold
from engine.cp.blocks import (BELOW, DIAGONAL, FULL, accumulation_dtype, block_backward,
                              block_forward, merge)
from engine.cp.checks import check_attention_inputs, check_same_on_every_rank
from engine.cp.layout import LAYOUTS, check_sequence_split, rank_chunks
from engine.validation import one_of


def block_pairs(rank: int, src: int, n: int, layout: str, causal: bool
                ) -> list[tuple[int, int, str]]:
    """``(query chunk, key chunk, kind)`` pairs ``rank`` computes against ``src``'s K/V, as
    indices into each rank's local chunks; fully masked pairs are left out. In the striped
    layout a rank's tokens interleave with every other's: one block, on its diagonal when the
    source rank is this one or an earlier one, strictly below it when a later one."""
    if layout == "striped":
        return [(0, 0, FULL if not causal else DIAGONAL if src <= rank else BELOW)]
    pairs = []
    for a, q_chunk in enumerate(rank_chunks(rank, n, layout)):
        for b, k_chunk in enumerate(rank_chunks(src, n, layout)):
            if not causal or k_chunk < q_chunk:
                pairs.append((a, b, FULL))
            elif k_chunk == q_chunk:
                pairs.append((a, b, DIAGONAL))
    return pairs


def ring_schedule(n: int, layout: str, causal: bool) -> dict[int, list[list[tuple]]]:
    """``{rank: [pairs at step 0, step 1, ...]}``: the whole ring's work, before any rank
    runs (the load-balance figures count it)."""
    return {r: [block_pairs(r, (r - s) % n, n, layout, causal) for s in range(n)]
            for r in range(n)}


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout):
        me, n, right, left = ring_position(group)
        scale = 1 / math.sqrt(q.shape[-1])
        per_rank, acc = (2 if layout == "zigzag" else 1), accumulation_dtype(q.dtype)
        q_chunks = q.to(acc).chunk(per_rank, dim=-2)
        outs = [torch.zeros_like(c) for c in q_chunks]
        lses = [torch.full(c.shape[:-1], float("-inf"), dtype=acc, device=q.device)
                for c in q_chunks]
        kv = torch.stack([k, v]).contiguous()  # one message per step
        for step in range(n):
            if step < n - 1:
                incoming = torch.empty_like(kv)
                with comm_purpose("cp"):
                    works = start_exchange(kv, right, incoming, left, group)
                hold("forward", kv, incoming)
            k_chunks, v_chunks = (t.to(acc).chunk(per_rank, dim=-2) for t in kv)
            for a, b, kind in block_pairs(me, (me - step) % n, n, layout, causal):
                block = block_forward(q_chunks[a], k_chunks[b], v_chunks[b], scale, kind)
                outs[a], lses[a] = merge(outs[a], lses[a], *block)
            if step < n - 1:
                for work in works:
                    work.wait()
                kv = incoming
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.layout = group, causal, layout
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, layout = ctx.group, ctx.causal, ctx.layout
        me, n, right, left = ring_position(group)
        scale = 1 / math.sqrt(q.shape[-1])
        per_rank, acc = (2 if layout == "zigzag" else 1), accumulation_dtype(q.dtype)
        dout = dout.to(acc)
        delta = (dout * out).sum(-1)
        q_chunks, lse_chunks = q.to(acc).chunk(per_rank, -2), lse.chunk(per_rank, -1)
        dout_chunks, delta_chunks = dout.chunk(per_rank, -2), delta.chunk(per_rank, -1)
        dq = [torch.zeros_like(c) for c in q_chunks]
        kv = torch.stack([k, v]).contiguous()
        arrived = None  # the dK/dV accumulator received from the left
        for step in range(n):
            if step < n - 1:
                incoming = torch.empty_like(kv)
                with comm_purpose("cp"):
                    works = start_exchange(kv, right, incoming, left, group)
            k_chunks, v_chunks = (t.to(acc).chunk(per_rank, dim=-2) for t in kv)
            dk = [torch.zeros_like(c) for c in k_chunks]
            dv = [torch.zeros_like(c) for c in v_chunks]
            for a, b, kind in block_pairs(me, (me - step) % n, n, layout, causal):
                dq_ab, dk_ab, dv_ab = block_backward(
                    q_chunks[a], k_chunks[b], v_chunks[b], lse_chunks[a], dout_chunks[a],
                    delta_chunks[a], scale, kind)
                dq[a] += dq_ab
                dk[b] += dk_ab
                dv[b] += dv_ab
            share = torch.stack([torch.cat(dk, dim=-2), torch.cat(dv, dim=-2)])
            if step == 0:
                own = share  # this rank's share of the gradient of its own K/V
            else:
                travelling = (share.to(k.dtype, copy=True) if arrived is None
                              else (share + arrived).to(k.dtype))
                arrived = torch.empty_like(travelling)
                hold("backward", kv, incoming if step < n - 1 else kv[:0], own, share,
                     travelling, arrived)
                with comm_purpose("cp"):
                    exchange(travelling, right, arrived, left, group)
                arrived = arrived.to(acc)
            if step < n - 1:
                for work in works:
                    work.wait()
                kv = incoming
        dkv = own if arrived is None else own + arrived  # the others' shares, home at last
        return (torch.cat(dq, dim=-2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                   causal: bool = True, layout: str = "zigzag", check: bool = True
                   ) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence held by the group, exactly
    ``scaled_dot_product_attention`` on the gathered sequence (this rank's rows of it).

    ``q``: ``(batch, heads, S/N, head_dim)``, ``k`` and ``v``: ``(batch, kv_heads, S/N,
    head_dim)``, each this rank's part of the sequence in ``layout`` (see
    :func:`engine.cp.shard_sequence`). ``check`` first compares shapes across ranks.
    """
    one_of("layout", layout, LAYOUTS)
    check_attention_inputs(q, k, v, "ring_attention")
    n = dist.get_world_size(group)
    if layout == "zigzag" and q.shape[-2] % 2:
        raise ValueError(f"ring_attention: a zig-zag shard holds 2 equal chunks, but this rank "
                         f"holds {q.shape[-2]} tokens (the sequence must split into 2 x {n} "
                         "equal chunks)")
    if check:
        check_same_on_every_rank(q, k, group, "ring_attention")
        check_sequence_split(n * q.shape[-2], n, layout)
    return _RingAttention.apply(q, k, v, group, causal, layout)
