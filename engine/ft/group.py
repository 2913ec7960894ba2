"""The cross-replica Gloo group of one quorum, built over the store for that quorum only.

``torch.distributed.ProcessGroupGloo(PrefixStore("pg/<qid>/", store), rank, size)`` connects
the members of quorum ``qid`` (their rank: their place in the sorted member list) without
``init_process_group`` (one such group per local rank ``tag`` of the replica groups: rank
``l`` of every member group): no global world, so a replica can die and the others build a new group
without it, and a restarted replica can join one. The group is rebuilt only when the quorum's
``qid`` changes. A peer that died makes the group's next operation raise (Gloo: "Connection
closed by peer"), within ``timeout_s`` at worst.

Its ops are called on the ``ProcessGroup`` object directly (``pg.allreduce([t])``), so they do
not go through :mod:`engine.comm.ops` and no ``CommMeter`` counts them; ``allreduce_bytes``
(the ring model's bytes of each finished all-reduce) and ``recovery_bytes`` (exact) count
what this rank sent instead.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from engine import theory
from engine.ft.quorum import Quorum


class QuorumGroup:
    """Holds the Gloo group of the current quorum of replica ``replica``."""

    def __init__(self, store, replica: int, timeout_s: float = 5.0, tag: str = "l0"):
        self.store, self.replica, self.timeout_s, self.tag = store, replica, timeout_s, tag
        self.qid: str | None = None
        self.pg = None
        self.size = 0
        self.allreduce_bytes = 0  # sent in committed-or-not all-reduces that finished (ring)
        self.recovery_bytes = 0  # sent to recovering peers (exact)

    def use(self, quorum: Quorum) -> None:
        """Build the group of ``quorum`` unless it is the one in use."""
        if quorum.qid == self.qid and self.pg is not None:
            return
        self.pg = None  # dropping the old group closes its connections
        prefix = dist.PrefixStore(f"pg/{quorum.qid}/{self.tag}/", self.store)
        self.pg = dist.ProcessGroupGloo(prefix, quorum.rank_of(self.replica),
                                        len(quorum.members),
                                        datetime.timedelta(seconds=self.timeout_s))
        self.qid, self.size = quorum.qid, len(quorum.members)

    def drop(self) -> None:
        """Forget the group (after it failed): the next quorum builds a new one."""
        self.pg, self.qid = None, None

    def average(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean of ``tensor`` over the quorum, as a new tensor (the input is left
        intact)."""
        out = tensor.detach().clone()
        self.pg.allreduce([out]).wait()
        self.allreduce_bytes += round(theory.ring_all_reduce_bytes(out.numel() * out.element_size(),
                                                              self.size))
        return out.div_(self.size)

    def send_bytes(self, payload: torch.Tensor, to_rank: int) -> None:
        """Send a uint8 payload (its length first) to the member of rank ``to_rank``."""
        self.pg.send([torch.tensor([payload.numel()], dtype=torch.int64)], to_rank, 0).wait()
        self.pg.send([payload], to_rank, 1).wait()
        self.recovery_bytes += 8 + payload.numel()

    def recv_bytes(self, from_rank: int) -> torch.Tensor:
        length = torch.zeros(1, dtype=torch.int64)
        self.pg.recv([length], from_rank, 0).wait()
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self.pg.recv([payload], from_rank, 1).wait()
        return payload
