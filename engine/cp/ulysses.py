"""Ulysses: context parallelism by switching from sequence-sharded to head-sharded and back.

Jacobs et al., "DeepSpeed Ulysses: system optimizations for enabling training of extreme long
sequence transformer models" (2023), section 3. Each of ``N`` ranks holds ``S/N`` tokens of
every head. One all-to-all gives each rank *every* token of ``heads/N`` heads; attention then
runs locally, unchanged, on whole sequences; a second all-to-all brings the output back to
``S/N`` tokens of every head. Backward is the same two all-to-alls, reversed.

* **Bytes**: each all-to-all sends ``(N-1)/N`` of a rank's input (:func:`engine.theory.
  all_to_all_bytes`): q, k, v and the output, ``(S/N)(2 hidden + 2 kv_hidden)(N-1)/N`` per
  rank each way (:func:`engine.theory.ulysses_bytes`), falling as N grows.
* **The constraint**: a rank needs whole heads, so N must divide the query heads and, with
  grouped-query attention, the KV heads too (a model with 8 KV heads cannot go beyond 8 ranks).

The sequence is in the contiguous layout: rank ``r`` holds tokens ``r S/N .. (r+1) S/N - 1``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.comm.autograd import all_to_all
from engine.cp.checks import check_attention_inputs, check_same_on_every_rank
from engine.validation import positive_int


def check_ulysses_heads(heads: int, kv_heads: int, n: int) -> None:
    """Raise a ValueError unless ``n`` ranks can each take whole query and KV heads."""
    positive_int("n", n)
    for name, value in (("query heads", heads), ("KV heads", kv_heads)):
        if value % n:
            raise ValueError(f"Ulysses gives each rank whole heads: {value} {name} do not split "
                             f"over {n} ranks ({value} % {n} = {value % n}); use a degree that "
                             f"divides {value}, or ring attention")


def heads_all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int
                     ) -> torch.Tensor:
    """Cut ``x`` into N pieces along ``scatter_dim``, send piece j to rank j, and concatenate
    what arrives (rank order) along ``gather_dim``. Differentiable: the pieces travel stacked
    along dim 0 through :func:`engine.comm.autograd.all_to_all`, whose backward is the same
    exchange the other way."""
    n = dist.get_world_size(group)
    pieces = torch.stack(x.chunk(n, dim=scatter_dim))
    if n > 1:
        pieces = all_to_all(pieces, group=group)
    return torch.cat(pieces.unbind(0), dim=gather_dim)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                      causal: bool = True, check: bool = True) -> torch.Tensor:
    """``scaled_dot_product_attention`` over the whole sequence, for this rank's ``S/N``
    tokens (contiguous layout). ``q``: ``(batch, heads, S/N, head_dim)``; ``k``, ``v``:
    ``(batch, kv_heads, S/N, head_dim)``. Two all-to-alls forward, two backward."""
    check_attention_inputs(q, k, v, "ulysses_attention")
    n = dist.get_world_size(group)
    b, heads, s, d = q.shape
    kv_heads = k.shape[1]
    check_ulysses_heads(heads, kv_heads, n)
    if check:
        check_same_on_every_rank(q, k, group, "ulysses_attention")
    # rank j's piece along dim 1 is [its query heads, its k heads, its v heads]
    qkv = torch.cat([t.reshape(b, n, t.shape[1] // n, s, d) for t in (q, k, v)], dim=2)
    qkv = heads_all_to_all(qkv.flatten(1, 2), group, 1, 2)  # (b, heads/N + 2 kv/N, S, d)
    q, k, v = qkv.split([heads // n, kv_heads // n, kv_heads // n], dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                         enable_gqa=kv_heads != heads)
    return heads_all_to_all(out, group, 2, 1)  # (b, heads, S/N, d)
