"""engine.launch: the rendezvous store outlives every rank. ``dist.new_group`` returns at once
on a rank outside the group, while the group's members still meet through the store; when
rank 0 served it, a rank 0 outside a group could finish first and take it away (chapter 07's
8-rank mesh cell failed once with "Failed to recv"; this test with "Broken pipe"). A process of
its own served it next; now it is a file (engine.launch.rank.rendezvous), which no rank takes
away."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tests.helpers import run_ranks


def _late_group(rank, world_size):
    if rank != 0:
        time.sleep(1.0)  # rank 0 is outside the group: its new_group returns at once
    group = dist.new_group([1, 2])  # the members meet through the store
    if rank != 0:
        dist.all_reduce(torch.ones(1), group=group)
    return rank


def test_a_rank_outside_a_group_may_finish_while_the_members_still_meet():
    assert run_ranks(_late_group, 3) == [0, 1, 2]
