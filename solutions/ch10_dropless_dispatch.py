"""Reference for exercise ch10.dropless_dispatch (the engine's version is
engine/moe/dropless.py)."""

import torch
import torch.distributed as dist

from engine.comm import ops
from engine.moe import all_to_all


def dropless_moe(x, expert, gate, experts, num_experts, group=None):
    n = dist.get_world_size(group)
    local = num_experts // n
    tokens, k = expert.shape
    token = torch.arange(tokens).repeat_interleave(k)  # one row per assignment
    flat = expert.reshape(-1)
    order = torch.argsort(flat, stable=True)  # rows by expert, so by destination rank
    counts = torch.bincount(flat, minlength=num_experts)
    incoming = torch.empty_like(counts)
    ops.all_to_all_single(incoming, counts, group=group)  # [source, my expert], flattened
    incoming = incoming.view(n, local)
    sent = counts.view(n, local).sum(dim=1).tolist()
    received = incoming.sum(dim=1).tolist()
    arrived = all_to_all(x[token][order], received, sent, group)
    source = torch.arange(n).repeat_interleave(local)
    my_expert = torch.arange(local).repeat(n)
    block = torch.repeat_interleave(my_expert * n + source, incoming.reshape(-1))
    regroup = torch.argsort(block, stable=True)  # by expert, then source rank
    blocks = arrived[regroup].split(incoming.sum(dim=0).tolist())
    y = torch.cat([e(b) for e, b in zip(experts, blocks)])  # each expert once, whole batch
    by_source = y.new_empty(y.shape).index_copy(0, regroup, y)
    back = all_to_all(by_source, sent, received, group)  # the splits swapped
    rows = back.new_empty(back.shape).index_copy(0, order, back)  # the sort undone
    weighted = rows * gate.reshape(-1, 1)
    return x.new_zeros(x.shape).index_add(0, token, weighted)
