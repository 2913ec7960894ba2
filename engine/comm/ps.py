"""All-reduce through a parameter server (Li et al., "Scaling distributed machine learning with
the parameter server", OSDI 2014), reduced to its communication pattern.

Every worker sends its whole tensor to one server rank, which sums and sends the result back.
A worker moves S out and S in. The server moves (N-1)·S each way (here the server is one of
the N ranks, so its own tensor never crosses the wire; with a dedicated server and N workers
it is N·S). The server's link carries N-1 times what any worker's does: that link, not the
total, is why a ring scales better than a single server (``theory.ps_all_reduce_bytes``).
Real parameter servers shard the parameters over many servers; with one shard on each of N
nodes, each node moves 2(N-1)/N·S, like the ring.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.comm import p2p
from engine.comm.checks import check_same_everywhere, validate


def ps_all_reduce(t: torch.Tensor, group=None, op="sum", server: int = 0,
                  check: bool = True) -> torch.Tensor:
    """Sum (or average) ``t`` over the group through ``server`` (a global rank); in place."""
    op = validate(t, op)
    ranks = p2p.group_ranks(group)
    if server not in ranks:
        raise ValueError(f"server={server} is not a rank of the group {list(ranks)}")
    if check:
        check_same_everywhere(t, group)
    if not t.numel():
        return t
    if dist.get_rank() == server:
        incoming = torch.empty_like(t)
        for worker in ranks:
            if worker != server:
                p2p.recv(incoming, worker, group)
                t.add_(incoming)
        if op == "avg":
            t.div_(len(ranks))
        for worker in ranks:
            if worker != server:
                p2p.send(t, worker, group)
    else:
        p2p.send(t, server, group)
        p2p.recv(t, server, group)
    return t
