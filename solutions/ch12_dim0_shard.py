"""Reference for exercise ch12.dim0_shard (the engine's version is engine/fsdp/shard.py,
DimZeroShard, and engine.fsdp.gather_full)."""

import torch
import torch.distributed as dist

from engine.comm import ops


def dim0_chunk(full, rank, world_size):
    chunk = -(-full.shape[0] // world_size)  # ceil
    out = torch.zeros(chunk, *full.shape[1:], dtype=full.dtype)
    mine = full[rank * chunk:(rank + 1) * chunk]  # may be short, or empty
    out[:len(mine)] = mine
    return out


def gather_dim0(chunk, rows, group=None):
    n = dist.get_world_size(group)
    send = chunk.contiguous()
    received = torch.empty(n * send.shape[0], *send.shape[1:], dtype=send.dtype)
    ops.all_gather_into_tensor(received, send, group=group)
    return received[:rows]
