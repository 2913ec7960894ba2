"""One rank of a replica group's training step under per-step fault tolerance.

A replica group is ``group_size`` ranks that train as one data-parallel replica (HSDP's
shape: reduce inside, then across). Per step (:meth:`FaultTolerantReplica.train_step`):

1. **quorum**: the group's leader (local rank 0) joins the round (step, attempt) and
   publishes the decided members to its group (:class:`engine.ft.quorum.QuorumClient`);
2. **group**: each local rank ``l`` uses the Gloo group of rank ``l`` of every member
   replica group, built anew when the members changed (:class:`engine.ft.group.QuorumGroup`);
   inside the replica group, its ranks' own Gloo group, built anew after a failed round
   (:meth:`FaultTolerantReplica._inner_group`);
3. **recovery**: the ranks of a group behind the quorum's source receive, from the source
   group's rank of the same local index, its parameters, optimizer state and step
   (:mod:`engine.ft.state`); bit for bit, from memory;
4. **gradient**: computed on this rank's batch of the step; averaged inside the group, then
   each local rank all-reduces its ``1/group_size`` slice over the live members only (the
   bytes across replica groups cut by the group size), then the slices are all-gathered
   inside the group;
5. **commit**: the step is applied only if every rank of every member finished (a two-phase
   commit on the store). A member that died mid-step makes the others' all-reduce raise or
   its commit never come: the round is aborted and retried as attempt + 1 without it (the
   gradient of the same batch at the same parameters, computed again). No survivor restarts.
   Only communication errors abort a round: an error in the caller's loss is raised at once.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist
from torch import nn

from engine.ft.group import QuorumGroup
from engine.ft.quorum import Quorum, QuorumClient, commit_round
from engine.ft.state import pack_state, state_digest, unpack_state


class FaultTolerantReplica:
    """Local rank ``local_rank`` of replica group ``replica`` (0..replicas-1) on ``store``.

    ``incarnation``: 0 at the first start, +1 at every restart; a restarted group holds
    nothing (``completed = -1``) until a live peer sends it the state.
    ``log``: one entry per committed step: ``(step, members, seconds, attempts)``.
    """

    def __init__(self, store, replica: int, replicas: int, model: nn.Module,
                 optimizer: torch.optim.Optimizer, incarnation: int = 0,
                 deadline_s: float = 1.0, timeout_s: float = 5.0, join_timeout_s: float = 10.0,
                 local_rank: int = 0, group_size: int = 1):
        self.store, self.replica, self.incarnation = store, replica, incarnation
        self.local_rank, self.group_size = local_rank, group_size
        self.model, self.optimizer = model, optimizer
        self.deadline_s, self.timeout_s, self.join_timeout_s = deadline_s, timeout_s, \
            join_timeout_s
        self.quorum = QuorumClient(store, replica, replicas, incarnation, deadline_s,
                                   join_timeout_s) if local_rank == 0 else None
        self.group = QuorumGroup(store, replica, timeout_s, tag=f"l{local_rank}")
        self.inner = None  # the group's own Gloo group (group_size > 1), per round: _inner
        self.inner_builds = 0  # how many were built (one, unless a round failed)
        self.max_attempts = 10  # rounds of one step before giving up (never loop forever)
        self.completed = 0 if incarnation == 0 else -1
        self.decisions = 0  # quorums published to (leader) or read from (others) the group
        self.log: list[tuple[int, tuple[int, ...], float, int]] = []
        self.recovered_step: int | None = None
        self.recovered_digest: str | None = None  # of the state it loaded
        self.sent_digests: dict[int, str] = {}  # step -> digest of the state it sent

    # -- rounds -------------------------------------------------------------------------------

    def _open_round(self, not_this: str | None = None) -> tuple[int, int]:
        """The round the live replicas are in (a rejoining replica joins that one)."""
        give_up = time.monotonic() + self.timeout_s
        while time.monotonic() < give_up:
            if self.store.check(["round"]):
                key = self.store.get("round").decode()
                if key != not_this:
                    step, attempt = key.split(".")
                    return int(step), int(attempt)
            time.sleep(0.002)
        raise TimeoutError(f"replica {self.replica}: no open round within {self.timeout_s} s")

    def _decide(self, step: int, attempt: int, broken: bool) -> Quorum:
        """The leader joins the round and publishes the quorum; the other ranks read it."""
        key = f"gq/{self.replica}.{self.incarnation}/{self.decisions}"
        self.decisions += 1
        if self.quorum is not None:
            quorum = self.quorum.join(step, attempt, self.completed, broken)
            if self.group_size > 1:
                self.store.set(key, quorum.to_json())
            return quorum
        self.store.wait([key], datetime.timedelta(seconds=self.timeout_s + self.join_timeout_s))
        return Quorum.from_json(self.store.get(key))

    def train_step(self, loss_of_step, before_average=None) -> Quorum:
        """One committed step. ``loss_of_step(step)``: this rank's loss on its batch of
        ``step`` at the current parameters. ``before_average(step, quorum)``: called just
        before the all-reduce (the tests kill a replica group there)."""
        started = time.perf_counter()
        if self.completed >= 0 or self.quorum is None:
            step, attempt = self.completed, 0
        else:
            step, attempt = self._open_round()
        broken, failure = False, None
        while True:
            quorum = self._decide(step, attempt, broken)
            step, attempt = quorum.step, quorum.attempt
            if self.replica not in quorum.members:  # came too late: follow the next round
                if self.quorum is not None:
                    step, attempt = self._open_round(not_this=f"{step}.{attempt}")
                continue
            average, ok = None, False
            try:  # the network: a peer may be gone while connecting or sending the state
                self.group.use(quorum)
                self._recover(quorum)
            except RuntimeError as e:
                self.group.drop()
                failure = e
            else:  # the loss is the caller's code: an error there is raised, never retried
                grad = self._gradient(loss_of_step, step)
                try:
                    if before_average is not None:
                        before_average(step, quorum)
                    average, ok = self._average(grad, quorum), True
                except RuntimeError as e:  # a peer gone during the all-reduce
                    self.group.drop()
                    failure = e
            parties = [f"{m}.{r}" for m in quorum.members for r in range(self.group_size)]
            if commit_round(self.store, quorum, ok, f"{self.replica}.{self.local_rank}",
                            parties, self.deadline_s):
                self._apply(average)
                self.completed = step + 1
                self.log.append((step, quorum.members, time.perf_counter() - started,
                                 attempt))
                return quorum
            self.group.drop()
            self.inner = None  # its ranks may have stopped at different collectives
            attempt, broken = attempt + 1, True
            if attempt >= self.max_attempts:
                raise RuntimeError(f"replica {self.replica}: step {step} failed {attempt} "
                                   "times in a row; giving up") from failure

    # -- the parts of a step ----------------------------------------------------------------

    def _recover(self, quorum: Quorum) -> None:
        if not quorum.recovering:
            return
        if self.replica == quorum.source:
            payload = pack_state(self.model, self.optimizer, self.completed)
            self.sent_digests[quorum.step] = state_digest(self.model, self.optimizer)
            for member in quorum.recovering:
                self.group.send_bytes(payload, quorum.rank_of(member))
        elif self.replica in quorum.recovering:
            payload = self.group.recv_bytes(quorum.rank_of(quorum.source))
            self.completed = unpack_state(payload, self.model, self.optimizer)
            self.recovered_step = quorum.step
            self.recovered_digest = state_digest(self.model, self.optimizer)

    def _gradient(self, loss_of_step, step: int) -> torch.Tensor:
        self.optimizer.zero_grad()
        loss_of_step(step).backward()
        return torch.cat([p.grad.reshape(-1) for p in self._params()])

    def _inner_group(self, quorum: Quorum):
        """The Gloo group of this replica group's ranks, built for the round ``quorum`` and
        kept while rounds commit. After a failed round every rank of the group drops it (all
        learn the same outcome from the commit): one rank may have left it mid-collective
        (its cross-replica all-reduce failed) while another was still in the next one (the
        all-gather), so the two no longer agree on which collective comes next. The new one,
        keyed by the round, starts them in step again."""
        if self.inner is None:
            prefix = f"inner/{self.replica}.{self.incarnation}/{quorum.step}.{quorum.attempt}/"
            self.inner = dist.ProcessGroupGloo(
                dist.PrefixStore(prefix, self.store), self.local_rank, self.group_size,
                datetime.timedelta(seconds=self.timeout_s))
            self.inner_builds += 1
        return self.inner

    def _average(self, grad: torch.Tensor, quorum: Quorum) -> torch.Tensor:
        """The mean over the group's ranks, then over the live member groups."""
        if self.group_size == 1:
            return self.group.average(grad)
        inner = self._inner_group(quorum)
        n, size = grad.numel(), self.group_size
        chunk = -(-n // size)
        padded = torch.zeros(chunk * size, dtype=grad.dtype)
        padded[:n] = grad
        inner.allreduce([padded]).wait()
        padded.div_(size)
        mine = self.group.average(padded[self.local_rank * chunk:(self.local_rank + 1) * chunk])
        pieces = [torch.empty_like(mine) for _ in range(size)]
        inner.allgather([pieces], [mine]).wait()
        return torch.cat(pieces)[:n]

    def _apply(self, average: torch.Tensor) -> None:
        offset = 0
        for p in self._params():
            p.grad = average[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        self.optimizer.step()

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]
