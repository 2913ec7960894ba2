"""Reference for exercise ch10.dispatch (the engine's version is engine/moe/dispatch.py)."""

import torch
import torch.distributed as dist

from engine.comm import ops
from engine.moe import all_to_all


def dispatch(tokens, expert, num_experts, group=None):
    n = dist.get_world_size(group)
    local = num_experts // n
    order = torch.argsort(expert, stable=True)  # rows by expert, so by destination rank
    counts = torch.bincount(expert, minlength=num_experts)
    incoming = torch.empty_like(counts)
    ops.all_to_all_single(incoming, counts, group=group)  # [source, my expert], flattened
    incoming = incoming.view(n, local)
    sent = counts.view(n, local).sum(dim=1).tolist()
    received = incoming.sum(dim=1).tolist()
    arrived = all_to_all(tokens[order], received, sent, group)
    source = torch.arange(n).repeat_interleave(local)  # the block order as it arrives
    my_expert = torch.arange(local).repeat(n)
    block = torch.repeat_interleave(my_expert * n + source, incoming.reshape(-1))
    regroup = torch.argsort(block, stable=True)  # by expert, then source rank
    state = (order, regroup, sent, received, group)
    return arrived[regroup], incoming.sum(dim=0).tolist(), state


def combine(outputs, state):
    order, regroup, sent, received, group = state
    by_source = outputs.new_empty(outputs.shape).index_copy(0, regroup, outputs)  # regroup undone
    back = all_to_all(by_source, sent, received, group)  # the splits swapped
    return back.new_empty(back.shape).index_copy(0, order, back)  # the sort undone
