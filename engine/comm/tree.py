"""All-reduce over a binomial tree: reduce up to rank 0, then broadcast back down.

Each phase takes ceil(log2 N) rounds instead of the ring's N-1 steps, so for small messages,
where every step costs a fixed latency, the tree wins. But on its critical path the whole
tensor crosses a link in every round (2·ceil(log2 N)·S in all), so for large messages the
ring's 2(N-1)/N·S wins. NCCL's double binary tree (Sanders, Speck & Träff 2009) runs two
pipelined trees, each on half the data, arranged so that each rank is an inner node in at
most one of them: near-full bandwidth at log N latency. This single, unpipelined tree shows
the idea.

Traffic per rank: every rank but the root sends S up once and receives S down once; a rank
with c children also receives c·S up and sends c·S down (``theory.tree_all_reduce_bytes``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.comm import p2p
from engine.comm.checks import check_same_everywhere, validate


def tree_children(index: int, n: int) -> list[int]:
    """Children of ``index`` in the binomial tree over ``0..n-1`` rooted at 0."""
    children, mask = [], 1
    while mask < n:
        if index % (2 * mask):  # the bit at `mask` or below is set: no children from here on
            break
        if index + mask < n:
            children.append(index + mask)
        mask *= 2
    return children


def tree_all_reduce(t: torch.Tensor, group=None, op="sum", check: bool = True) -> torch.Tensor:
    """Sum (or average) ``t`` over the group with a binomial tree; in place, returns ``t``."""
    op = validate(t, op)
    if check:
        check_same_everywhere(t, group)
    ranks = p2p.group_ranks(group)
    n, me = len(ranks), ranks.index(dist.get_rank())
    if n == 1 or not t.numel():
        return t
    children = tree_children(me, n)
    parent = None if me == 0 else me - (me & -me)  # clear the lowest set bit
    incoming = torch.empty_like(t)
    for child in children:  # reduce: children's subtree sums flow up
        p2p.recv(incoming, ranks[child], group)
        t.add_(incoming)
    if parent is not None:
        p2p.send(t, ranks[parent], group)
        p2p.recv(t, ranks[parent], group)  # the total flows back down
    elif op == "avg":
        t.div_(n)
    for child in reversed(children):
        p2p.send(t, ranks[child], group)
    return t
