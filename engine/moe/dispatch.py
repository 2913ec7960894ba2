"""Dispatch and combine: (token, expert) rows to the ranks holding their experts, and back.

Expert parallelism spreads the ``E`` experts of a layer over the ``n`` ranks of a group, ``E/n``
consecutive experts each (rank r holds experts ``r E/n .. (r+1) E/n - 1``). Every rank routes
its own tokens, so every rank has rows for every expert. The dispatch (as in Lepikhin et
al., GShard, ICLR 2021, where dispatch and combine are all-to-alls):

1. sort this rank's rows by expert, so the rows for each destination rank are consecutive,
   and within them the rows of each of its experts;
2. exchange the counts: one all-to-all of ``E`` integers tells every rank how many rows of each
   of its experts arrive from every other rank (the splits of the next step are uneven and
   change every batch, so they must be agreed first);
3. exchange the rows: one all-to-all with those uneven splits;
4. regroup what arrived (ordered by source rank, then expert) by expert, then source rank, so
   each local expert gets its rows as one block.

The combine undoes it: regroup back, one all-to-all with the splits swapped, unsort. Both
all-to-alls are differentiable: the gradient of an all-to-all is the all-to-all with input
and output splits swapped, so backward crosses the wire the same two times, reversed
(:func:`engine.comm.autograd.all_to_all`, shared with Ulysses).
Everything goes through :mod:`engine.comm.ops`, so a ``CommMeter`` sees (and inside
``CommMeter(count="wire")`` counts) every byte, each all-to-all (backward's too) tagged
``comm_purpose("ep")``: expert-parallel traffic, whatever other group holds the same ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.comm import ops
from engine.comm.autograd import all_to_all  # differentiable; re-exported by engine.moe
from engine.observe.meter import comm_purpose
from engine.validation import divides


def exchange_counts(counts: torch.Tensor, group=None) -> torch.Tensor:
    """``counts[e]``: this rank's rows for global expert e. Returns ``[n, E/n]``: row s holds
    how many rows of each of this rank's experts rank s sends (one all-to-all of E ints)."""
    n = dist.get_world_size(group)
    received = torch.empty_like(counts)
    with comm_purpose("ep"):
        ops.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(n, -1)


@dataclass
class DispatchState:
    """What :func:`combine` needs to send rows back where they came from."""

    order: torch.Tensor  # this rank's rows sorted by expert: rows[order]
    sent: list[int]  # rows sent to each rank
    received: list[int]  # rows received from each rank
    regroup: torch.Tensor  # arrived rows (by source, expert) -> (by expert, source)
    group: object


def dispatch(rows: torch.Tensor, expert: torch.Tensor, num_experts: int, group=None
             ) -> tuple[torch.Tensor, list[int], DispatchState]:
    """Send each row of ``rows`` [M, h] to the rank holding expert ``expert[i]``.

    Returns the rows this rank's experts must process, one block per local expert (by source
    rank, then in the sender's order, within a block), the block sizes, and the state
    :func:`combine` needs.
    """
    n = dist.get_world_size(group)
    divides("the ranks in group", n, "num_experts", num_experts)
    local = num_experts // n
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=num_experts)
    from_each = exchange_counts(counts, group)  # [n sources, local experts]
    sent = counts.view(n, local).sum(dim=1).tolist()
    received = from_each.sum(dim=1).tolist()
    with comm_purpose("ep"):
        arrived = all_to_all(rows[order], received, sent, group)
    # arrived is ordered (source, expert); regroup it (expert, source)
    block = torch.repeat_interleave(torch.arange(n * local, device=rows.device),
                                    from_each.reshape(-1))
    source, local_expert = block // local, block % local
    regroup = torch.argsort(local_expert * n + source, stable=True)
    state = DispatchState(order, sent, received, regroup, group)
    return arrived[regroup], from_each.sum(dim=0).tolist(), state


def combine(outputs: torch.Tensor, state: DispatchState) -> torch.Tensor:
    """The inverse of :func:`dispatch`: ``outputs`` (one row per dispatched row, in the order
    :func:`dispatch` returned them) back to their ranks, in the order of the original rows."""
    by_source = outputs[inverse(state.regroup)]
    with comm_purpose("ep"):
        back = all_to_all(by_source, state.sent, state.received, state.group)
    return back[inverse(state.order)]


def inverse(permutation: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes ``permutation``: ``x[p][inverse(p)] == x``."""
    undo = torch.empty_like(permutation)
    undo[permutation] = torch.arange(len(permutation), device=permutation.device)
    return undo
