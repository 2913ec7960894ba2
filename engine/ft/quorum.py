"""The quorum of one step: which replica groups take part, decided once through a store.

Every live replica writes ``join/<step>.<attempt>/<id>`` (what it holds: how many steps it has
completed, -1 if it needs its state from a peer; its incarnation). It then waits until every
*expected* replica has joined or the deadline passes. Expected are the members of the last
quorum it saw and any replica that announced a restart (``want/<id>`` with an incarnation not
yet seen). The deadline is ``deadline_s`` (how long a dead member can hold a step), or
``join_timeout_s`` at the first start and while a restarted replica is on its way. The first replica to finish waiting proposes the set of replicas that joined, with
``TCPStore.compare_set``; the first proposal wins and every replica adopts it, so they agree
even when they saw different joins. A replica that joined too late is not in the quorum and
tries the next round.

The quorum also names the *source* (the member that completed the most steps, lowest id first)
and the members that must fetch the state from it, and a group id ``qid``: the Gloo group of
the last quorum is reused only when the members are the same and the last round did not fail.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from engine.validation import positive_number


@dataclass(frozen=True)
class Quorum:
    """The decision for round (``step``, ``attempt``)."""

    step: int
    attempt: int
    members: tuple[int, ...]
    completed: dict  # member id -> steps it has completed (-1: holds nothing yet)
    incarnations: dict  # member id -> incarnation (restarts so far)
    qid: str

    @property
    def source(self) -> int:
        """The member whose state the others recover from: most steps completed, lowest id."""
        return min(self.members, key=lambda m: (-self.completed[m], m))

    @property
    def recovering(self) -> tuple[int, ...]:
        """Members behind the source: they receive its parameters and optimizer state."""
        best = self.completed[self.source]
        return tuple(m for m in self.members if self.completed[m] < best)

    def rank_of(self, replica: int) -> int:
        return self.members.index(replica)

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "attempt": self.attempt,
                           "members": list(self.members),
                           "completed": {str(k): v for k, v in self.completed.items()},
                           "incarnations": {str(k): v for k, v in self.incarnations.items()},
                           "qid": self.qid})

    @classmethod
    def from_json(cls, text) -> "Quorum":
        d = json.loads(text)
        return cls(d["step"], d["attempt"], tuple(d["members"]),
                   {int(k): v for k, v in d["completed"].items()},
                   {int(k): v for k, v in d["incarnations"].items()}, d["qid"])


class QuorumClient:
    """One replica's view of the quorum protocol on ``store`` (keys are plain strings)."""

    def __init__(self, store, replica: int, replicas: int, incarnation: int = 0,
                 deadline_s: float = 1.0, join_timeout_s: float = 10.0, poll_s: float = 0.002):
        positive_number("deadline_s", deadline_s)
        positive_number("join_timeout_s", join_timeout_s)
        self.join_timeout_s = join_timeout_s
        self.store, self.replica, self.replicas = store, replica, replicas
        self.incarnation, self.deadline_s, self.poll_s = incarnation, deadline_s, poll_s
        self.last: Quorum | None = None
        self.seen = {i: 0 for i in range(replicas)}  # incarnations the quorums have admitted
        store.set(f"want/{replica}", str(incarnation))

    def _wanting(self) -> set[int]:
        out = set()
        for i in range(self.replicas):
            if self.store.check([f"want/{i}"]) and int(self.store.get(f"want/{i}")) > self.seen[i]:
                out.add(i)
        return out

    def join(self, step: int, attempt: int, completed: int, broken: bool = False) -> Quorum:
        """Join round (``step``, ``attempt``); return the quorum decided for it (which may not
        include this replica, if it came too late). ``broken``: the last group failed."""
        key = f"{step}.{attempt}"
        if completed >= 0 and self._newer_than_open(step, attempt):
            self.store.set("round", key)  # a replica holding state opens rounds; others follow
        self.store.set(f"join/{key}/{self.replica}",
                       json.dumps([completed, self.incarnation, broken]))
        expected = (set(self.last.members) if self.last else set(range(self.replicas)))
        expected.add(self.replica)
        wanting = self._wanting()
        expected |= wanting
        # at the first start, and while a restarted replica is on its way, wait longer
        patient = self.last is None or bool(wanting - set(self.last.members))
        give_up = time.monotonic() + (self.join_timeout_s if patient else self.deadline_s)
        decided = f"quorum/{key}"
        while not self.store.check([decided]):
            joined = self._joined(key)
            if set(joined) >= expected or time.monotonic() > give_up:
                self._propose(step, attempt, joined)
                break
            time.sleep(self.poll_s)
        quorum = Quorum.from_json(self.store.get(decided))
        if self.replica in quorum.members:
            self.last = quorum
            for m in quorum.members:
                self.seen[m] = max(self.seen[m], quorum.incarnations[m])
        return quorum

    def _newer_than_open(self, step: int, attempt: int) -> bool:
        if not self.store.check(["round"]):
            return True
        open_step, open_attempt = map(int, self.store.get("round").decode().split("."))
        return (step, attempt) > (open_step, open_attempt)

    def _joined(self, key: str) -> dict[int, list]:
        return {i: json.loads(self.store.get(f"join/{key}/{i}")) for i in range(self.replicas)
                if self.store.check([f"join/{key}/{i}"])}

    def _propose(self, step: int, attempt: int, joined: dict[int, list]) -> None:
        members = tuple(sorted(joined))
        reuse = (self.last is not None and self.last.members == members and
                 not any(j[2] for j in joined.values()))
        proposal = Quorum(step, attempt, members, {i: j[0] for i, j in joined.items()},
                          {i: j[1] for i, j in joined.items()},
                          self.last.qid if reuse else f"{step}.{attempt}")
        self.store.compare_set(f"quorum/{step}.{attempt}", "", proposal.to_json())

    def commit(self, quorum: Quorum, ok: bool) -> bool:
        """:func:`commit_round` for a replica group of one rank."""
        return commit_round(self.store, quorum, ok, str(self.replica),
                            [str(m) for m in quorum.members], self.deadline_s, self.poll_s)


def commit_round(store, quorum: Quorum, ok: bool, me: str, parties: list[str],
                 deadline_s: float, poll_s: float = 0.002) -> bool:
    """Two-phase commit of a round: True only if every party (``"<replica>.<local rank>"``
    of every member) finished its all-reduce (``ok``), decided once for all with
    ``compare_set`` so that no two parties differ."""
    key = f"{quorum.step}.{quorum.attempt}"
    if ok:
        store.set(f"ok/{key}/{me}", "1")
    give_up = time.monotonic() + deadline_s
    decision = f"commit/{key}"
    while not store.check([decision]):
        done = all(store.check([f"ok/{key}/{p}"]) for p in parties)
        if done or not ok or time.monotonic() > give_up:
            store.compare_set(decision, "", "commit" if done else "abort")
            break
        time.sleep(poll_s)
    return store.get(decision) == b"commit"
