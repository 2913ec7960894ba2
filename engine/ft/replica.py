"""One replica group's training step under per-step fault tolerance.

Per step (:meth:`FaultTolerantReplica.train_step`):

1. **quorum**: join the round (step, attempt) and adopt the decided members
   (:class:`engine.ft.quorum.QuorumClient`);
2. **group**: use the quorum's Gloo group, built anew when the members changed
   (:class:`engine.ft.group.QuorumGroup`);
3. **recovery**: the members behind the quorum's source receive its parameters, optimizer
   state and step (:mod:`engine.ft.state`); bit for bit, from memory;
4. **gradient**: computed on this replica's batch of the step, then averaged over the live
   members only;
5. **commit**: the step is applied only if every member's all-reduce finished (a two-phase
   commit on the store). A member that died mid-step makes the others' all-reduce raise or
   its commit never come: the round is aborted and retried as attempt + 1 without it, on the
   same gradients. No survivor restarts.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from engine.ft.group import QuorumGroup
from engine.ft.quorum import Quorum, QuorumClient
from engine.ft.state import pack_state, state_digest, unpack_state


class FaultTolerantReplica:
    """``replica`` (0..replicas-1) of a fault-tolerant run on ``store``.

    ``incarnation``: 0 at the first start, +1 at every restart; a restarted replica holds
    nothing (``completed = -1``) until a live peer sends it the state.
    ``log``: one entry per committed step: ``(step, members, seconds, attempts)``.
    """

    def __init__(self, store, replica: int, replicas: int, model: nn.Module,
                 optimizer: torch.optim.Optimizer, incarnation: int = 0,
                 deadline_s: float = 1.0, timeout_s: float = 5.0, join_timeout_s: float = 10.0):
        self.store, self.replica = store, replica
        self.model, self.optimizer = model, optimizer
        self.quorum = QuorumClient(store, replica, replicas, incarnation, deadline_s,
                                   join_timeout_s)
        self.group = QuorumGroup(store, replica, timeout_s)
        self.timeout_s = timeout_s
        self.max_attempts = 10  # rounds of one step before giving up (never loop forever)
        self.completed = 0 if incarnation == 0 else -1
        self.log: list[tuple[int, tuple[int, ...], float, int]] = []
        self.recovered_from: int | None = None
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

    def train_step(self, loss_of_step, before_average=None) -> Quorum:
        """One committed step. ``loss_of_step(step)``: this replica's loss on its batch of
        ``step`` at the current parameters. ``before_average(step, quorum)``: called just
        before the all-reduce (the tests kill a replica there)."""
        started = time.perf_counter()
        if self.completed >= 0:
            step, attempt = self.completed, 0
        else:
            step, attempt = self._open_round()
        broken = False
        while True:
            quorum = self.quorum.join(step, attempt, self.completed, broken)
            if self.replica not in quorum.members:  # came too late: follow the next round
                step, attempt = self._open_round(not_this=f"{step}.{attempt}")
                continue
            average, ok = None, False
            try:
                self.group.use(quorum)
                self._recover(quorum)
                grad = self._gradient(loss_of_step, step)
                if before_average is not None:
                    before_average(step, quorum)
                average, ok = self.group.average(grad), True
            except RuntimeError:
                self.group.drop()
            if self.quorum.commit(quorum, ok):
                self._apply(average)
                self.completed = step + 1
                self.log.append((step, quorum.members, time.perf_counter() - started,
                                 attempt))
                return quorum
            self.group.drop()
            attempt, broken = attempt + 1, True
            if attempt >= self.max_attempts:
                raise RuntimeError(f"replica {self.replica}: step {step} failed {attempt} "
                                   "times in a row; giving up")

    # -- the parts of a step ----------------------------------------------------------------

    def _recover(self, quorum: Quorum) -> None:
        if not quorum.recovering:
            return
        source = quorum.rank_of(quorum.source)
        if self.replica == quorum.source:
            payload = pack_state(self.model, self.optimizer, self.completed)
            self.sent_digests[quorum.step] = state_digest(self.model, self.optimizer)
            for member in quorum.recovering:
                self.group.send_bytes(payload, quorum.rank_of(member))
        elif self.replica in quorum.recovering:
            payload = self.group.recv_bytes(source)
            self.completed = unpack_state(payload, self.model, self.optimizer)
            self.recovered_from, self.recovered_step = quorum.source, quorum.step
            self.recovered_digest = state_digest(self.model, self.optimizer)

    def _gradient(self, loss_of_step, step: int) -> torch.Tensor:
        self.optimizer.zero_grad()
        loss_of_step(step).backward()
        return torch.cat([p.grad.reshape(-1) for p in self._params()])

    def _apply(self, average: torch.Tensor) -> None:
        offset = 0
        for p in self._params():
            p.grad = average[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        self.optimizer.step()

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]
