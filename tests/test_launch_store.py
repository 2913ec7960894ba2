"""engine.launch: rank 0 serves the rendezvous store, and must not take it away while another
rank still needs it. ``dist.new_group`` returns at once on a rank outside the group, while
the group's members still meet through the store (chapter 07's 8-rank mesh cell failed with
"Failed to recv" when rank 0, outside a group, finished first)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tests.helpers import run_ranks


def _late_group(rank, world_size):
    if rank != 0:
        time.sleep(1.0)  # rank 0 is outside the group: its new_group returns at once
    group = dist.new_group([1, 2])  # the members meet through rank 0's store
    if rank != 0:
        dist.all_reduce(torch.ones(1), group=group)
    return rank


def test_rank_0_keeps_the_store_until_every_rank_is_done_with_it():
    assert run_ranks(_late_group, 3) == [0, 1, 2]
