"""Surviving failures under torchrun: workers that die with their agent, a lost peer named,
and a deliberate kill for labs and tests.

torchrun (torchelastic) runs one *agent* per node; the agent starts the node's workers and,
with ``--max-restarts N``, restarts all of them (on every node, after a new rendezvous) when
one fails. A restarted ``engine train --resume`` continues from the newest complete checkpoint
(:mod:`engine.checkpoint.trainer`). These pieces make that hold up:

* :func:`die_with_agent`: a worker asks Linux to kill it when its agent dies
  (``PR_SET_PDEATHSIG``). torchrun's workers do not otherwise notice: an agent killed with
  SIGKILL (or a node's agent lost any other way) would leave them running, holding their
  GPU and their peers' connections.
* :class:`Peers`: where every rank runs (host, pid), gathered once at the start. When a
  collective fails because a peer vanished, Gloo says only "Connection closed by peer
  [address]:port"; :meth:`Peers.lost` names the ranks whose processes are gone (those on this
  host, checked by pid) or else the hosts the error points at. It tells such an error from
  any other as the launcher does (:func:`engine.launch.errors.says_peer_is_missing`).
* **On NCCL** a dead peer raises no Python error: the survivors' collective hangs until
  NCCL's watchdog aborts them after the group's timeout (``--timeout``). The trainer says so
  at the start (:func:`nccl_lost_peer_note`), and where NCCL's error does reach Python (its
  "Watchdog caught collective operation timeout"), :meth:`Peers.lost` names the ranks on this
  host whose processes are gone, as it does on Gloo.
* :func:`check_restartable`: a torchrun whose restarted workers could not connect (they
  would share the previous attempt's rendezvous store) is refused on its first attempt.
* :func:`kill_point`: **for labs and tests only**, ``engine train --kill-at-step K
  --kill-rank R`` sends SIGKILL to global rank R right after its K-th step, on torchrun's
  first attempt only (``TORCHELASTIC_RESTART_COUNT`` is 0), so the restarted workers run
  through. It is how the elastic test, and a lab, make a rank die at a chosen moment.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass

import torch.distributed as dist

from engine.launch import LaunchEnv, die_with_parent, says_peer_is_missing


class PeerLostError(RuntimeError):
    """A collective failed because other ranks are gone; ``ranks`` names them (empty when no
    process could be checked)."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


def restart_count() -> int:
    """How many times torchrun has restarted this worker group (0 outside torchrun)."""
    return LaunchEnv.read().restart_count


def check_restartable() -> None:
    """Refuse, on the first attempt, a torchrun that could not restart its workers.

    By default torchrun's workers share the rendezvous's TCP store, and each restart's
    workers find the previous attempt's keys in it: a restarted Gloo group reads the dead
    workers' addresses and fails ("Gloo connectFullMesh failed ... Connection refused";
    measured with torch 2.13; pytorch/pytorch#135712 describes the same for NCCL).
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives every attempt a fresh store."""
    env = LaunchEnv.read()
    restarts = env.max_restarts
    if restarts > 0 and env.agent_store_shared:
        raise ValueError(
            f"torchrun --max-restarts {restarts} with the rendezvous store shared with the "
            "workers: a restarted worker would read the previous attempt's addresses from it "
            "and fail to connect. Start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in "
            "its environment (each attempt then gets a fresh store)")


def die_with_agent() -> None:
    """Be killed (SIGKILL) when the process that started this one dies: the torchrun agent."""
    parent = os.getppid()
    die_with_parent()
    if os.getppid() != parent:  # the agent died before we asked
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class Peer:
    host: str
    pid: int


class Peers:
    """Every rank's host and pid, gathered over the default process group."""

    def __init__(self):
        here = Peer(socket.gethostname(), os.getpid())
        everyone: list[Peer | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, here)
        self.here, self.everyone = here, everyone

    @classmethod
    def of(cls, everyone: list[Peer], here: Peer) -> "Peers":
        """Peers from a table already known (``everyone[rank]``; ``here``: this process)."""
        peers = cls.__new__(cls)
        peers.here, peers.everyone = here, list(everyone)
        return peers

    def gone(self) -> list[int]:
        """Ranks on this host whose process no longer runs."""
        return [rank for rank, peer in enumerate(self.everyone)
                if peer.host == self.here.host and not _running(peer.pid)]

    def lost(self, error: BaseException) -> PeerLostError | None:
        """A :class:`PeerLostError` naming the lost ranks, if ``error`` is a collective that
        failed for want of a peer; None for any other error."""
        text = str(error)
        if not says_peer_is_missing(text):  # the launcher's own reading of such errors
            return None
        gone = self.gone()
        for _ in range(20):  # a killed peer's sockets close a moment before its process ends
            if gone:
                break
            time.sleep(0.1)
            gone = self.gone()
        for _ in range(10):  # peers killed together (an agent's workers) end a moment apart:
            time.sleep(0.1)  # name them all, once the set has stopped growing
            again = self.gone()
            if again == gone:
                break
            gone = again
        if gone:
            who = ", ".join(f"rank {r} (pid {self.everyone[r].pid} on {self.everyone[r].host})"
                            for r in gone)
            return PeerLostError(f"lost peer{'s' if len(gone) > 1 else ''}: {who} "
                                 f"{'are' if len(gone) > 1 else 'is'} gone. {_first_line(text)}",
                                 gone)
        elsewhere = sorted({p.host for p in self.everyone if p.host != self.here.host})
        ranks = [r for r, p in enumerate(self.everyone) if p.host in elsewhere]
        where = (f"ranks {', '.join(map(str, ranks))} on {', '.join(elsewhere)}"
                 if elsewhere else "no rank on this host is gone")
        return PeerLostError(f"lost a peer ({where}; every rank here is alive). "
                             f"{_first_line(text)}", [])


def nccl_lost_peer_note(timeout_s: float) -> str:
    """What a run on NCCL should know about lost peers (printed by the trainer at its start)."""
    return (f"on NCCL a lost peer raises no error here: the other ranks wait in their next "
            f"collective until NCCL's watchdog aborts them, after --timeout {timeout_s:g} s "
            "(the log says 'Watchdog caught collective operation timeout'). torchrun's failure "
            "summary names the rank that failed first (an exitcode other than the watchdog's "
            "abort); with --max-restarts the workers restart and resume. A shorter --timeout "
            "finds a lost peer sooner (but must exceed the slowest step and checkpoint save)")


def tell_how_nccl_loses_peers(timeout_s: float, out=None) -> bool:
    """On an NCCL default group, global rank 0 prints :func:`nccl_lost_peer_note`; whether
    the group is NCCL."""
    if dist.get_backend() != "nccl":
        return False
    if dist.get_rank() == 0:
        print(f"note: {nccl_lost_peer_note(timeout_s)}", file=out, flush=True)
    return True


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _first_line(text: str) -> str:
    return "The collective said: " + text.strip().splitlines()[0] if text.strip() else ""


def kill_point(steps_done: int, kill_at_step: int | None, kill_rank: int) -> None:
    """For labs and tests: SIGKILL this process if it is global rank ``kill_rank`` and has
    just done step ``kill_at_step``, on torchrun's first attempt (or outside torchrun)."""
    if kill_at_step is None or steps_done != kill_at_step or restart_count() != 0:
        return
    if dist.get_rank() == kill_rank:
        print(f"rank {kill_rank}: killed by --kill-at-step {kill_at_step} (a lab/test "
              "option)", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
