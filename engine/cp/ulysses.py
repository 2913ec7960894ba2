"""Ulysses: context parallelism by switching from sequence-sharded to head-sharded and back.

Jacobs et al., "DeepSpeed Ulysses: system optimizations for enabling training of extreme long
sequence transformer models" (2023), section 3. Each of ``N`` ranks holds ``S/N`` tokens of
every head. One all-to-all gives each rank *every* token of ``heads/N`` heads; attention then
runs locally, unchanged, on whole sequences; a second all-to-all brings the output back to
``S/N`` tokens of every head. Backward is the same two all-to-alls, reversed.

* **Bytes**: each all-to-all sends ``(N-1)/N`` of a rank's input (:func:`engine.theory.
  all_to_all_bytes`): q, k, v and the output, ``(S/N)(2 hidden + 2 kv_hidden')(N-1)/N`` per
  rank each way (:func:`engine.theory.ulysses_bytes`), where ``kv_hidden'`` counts the KV heads
  that travel (below). Without grouped-query attention this falls as 1/N and is below the
  ring's; with it, it beats the ring's ``2 S kv_hidden`` only when ``N > 1 + heads/kv_heads``
  (:func:`engine.theory.ulysses_beats_ring`).
* **The constraint**: a rank needs whole *query* heads, so N must divide the query heads. With
  grouped-query attention a rank also needs the KV head of each of its query heads: when N
  does not divide the KV heads (``N > kv_heads`` in particular) each KV head is replicated
  ``lcm(kv_heads, N) / kv_heads`` times before the all-to-all, so ``lcm(kv_heads, N)`` KV heads
  travel (:func:`engine.theory.ulysses_sent_kv_heads`), and backward sums the copies'
  gradients (autograd of ``repeat_interleave``). Megatron-Core and DeepSpeed replicate KV heads
  this way; DeepSpeed also added uneven head splits for N not dividing the heads.

The sequence is in the contiguous layout: rank ``r`` holds tokens ``r S/N .. (r+1) S/N - 1``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine import theory
from engine.comm.autograd import all_to_all
from engine.observe.meter import comm_purpose
from engine.cp.buffers import hold
from engine.cp.checks import check_attention_inputs, check_same_on_every_rank
from engine.validation import positive_int


def check_ulysses_heads(heads: int, kv_heads: int, n: int) -> int:
    """The KV heads that travel (``lcm(kv_heads, n)``, replicas included), or a ValueError
    unless ``n`` ranks can each take whole query heads."""
    positive_int("n", n)
    if heads % n:
        raise ValueError(f"Ulysses gives each rank whole heads: {heads} query heads do not split "
                         f"over {n} ranks ({heads} % {n} = {heads % n}); use a degree that "
                         f"divides {heads}, or ring attention")
    return theory.ulysses_sent_kv_heads(heads, kv_heads, n)


def replicate_kv_heads(t: torch.Tensor, travelling: int) -> torch.Tensor:
    """``(b, kv_heads, s, d)`` -> ``(b, travelling, s, d)``: each KV head repeated
    ``travelling / kv_heads`` times, so that rank j's ``travelling / N`` consecutive copies are
    the KV heads of its query heads ``j heads/N .. (j+1) heads/N - 1``."""
    return t.repeat_interleave(travelling // t.shape[1], dim=1) if travelling != t.shape[1] else t


def heads_all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int
                     ) -> torch.Tensor:
    """Cut ``x`` into N pieces along ``scatter_dim``, send piece j to rank j, and concatenate
    what arrives (rank order) along ``gather_dim``. Differentiable: the pieces travel stacked
    along dim 0 through :func:`engine.comm.autograd.all_to_all`, whose backward is the same
    exchange the other way; both are context-parallel traffic (``comm_purpose("cp")``: with
    an MoE model its group can hold the expert-parallel ranks)."""
    n = dist.get_world_size(group)
    pieces = torch.stack(x.chunk(n, dim=scatter_dim))
    if n > 1:
        with comm_purpose("cp"):
            pieces = all_to_all(pieces, group=group)
    return torch.cat(pieces.unbind(0), dim=gather_dim)


def scatter_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                  who: str = "ulysses_attention"):
    """The first all-to-all: this rank's ``S/N`` tokens of every head -> every token of its
    ``heads/N`` query heads and their KV heads (replicated as needed). Returns ``(q, k, v)``
    of shapes ``(b, heads/N, S, d)`` and ``(b, lcm(kv_heads, N)/N, S, d)``."""
    n = dist.get_world_size(group)
    b, heads, s, d = q.shape
    travelling = check_ulysses_heads(heads, k.shape[1], n)
    k, v = (replicate_kv_heads(t, travelling) for t in (k, v))
    # rank j's piece along dim 1 is [its query heads, its k heads, its v heads]
    qkv = torch.cat([t.reshape(b, n, t.shape[1] // n, s, d) for t in (q, k, v)], dim=2)
    qkv = heads_all_to_all(qkv.flatten(1, 2), group, 1, 2)  # (b, heads/N + 2 kv'/N, S, d)
    return qkv.split([heads // n, travelling // n, travelling // n], dim=1)


def gather_heads(out: torch.Tensor, group=None) -> torch.Tensor:
    """The second all-to-all: ``(b, heads/N, S, d)`` -> ``(b, heads, S/N, d)``."""
    return heads_all_to_all(out, group, 2, 1)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                      causal: bool = True, check: bool = True) -> torch.Tensor:
    """``scaled_dot_product_attention`` over the whole sequence, for this rank's ``S/N``
    tokens (contiguous layout). ``q``: ``(batch, heads, S/N, head_dim)``; ``k``, ``v``:
    ``(batch, kv_heads, S/N, head_dim)``; N must divide ``heads`` (KV heads are replicated
    when it does not divide ``kv_heads``). Two all-to-alls forward, two backward."""
    check_attention_inputs(q, k, v, "ulysses_attention")
    check_ulysses_heads(q.shape[1], k.shape[1], dist.get_world_size(group))
    if check:
        check_same_on_every_rank(q, k, group, "ulysses_attention")
    q, k, v = scatter_heads(q, k, v, group)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                         enable_gqa=k.shape[1] != q.shape[1])
    hold("forward", q, k, v, out)
    return gather_heads(out, group)  # (b, heads, S/N, d)
