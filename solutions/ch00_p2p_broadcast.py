"""Reference for exercise ch00.p2p_broadcast: a flat broadcast from point-to-point sends."""

import torch
import torch.distributed as dist

from engine.comm import ops


def p2p_broadcast(tensor: torch.Tensor, src: int) -> torch.Tensor:
    """Copy ``tensor`` from rank ``src`` into ``tensor`` on every rank, in place; return it.

    The source sends the whole tensor to each peer in turn: it puts (N-1)·S bytes on the wire,
    every other rank receives S. (A chain or a tree moves the same N-1 copies in total but
    spreads the sending over the ranks.)
    """
    if dist.get_rank() == src:
        for peer in range(dist.get_world_size()):
            if peer != src:
                ops.send(tensor, peer)
    else:
        ops.recv(tensor, src)
    return tensor
