"""Per-step fault tolerance from scratch: replica groups that drop out and rejoin without a
restart of the others (torchft's design: the repository github.com/pytorch/torchft, PyTorch,
2025).

Each step the live replica groups agree on a *quorum* through a ``TCPStore``
(:mod:`engine.ft.quorum`), all-reduce their gradients over a Gloo group built for that quorum
only (:mod:`engine.ft.group`), and commit the step only when every member finished its
all-reduce; a replica that restarts fetches the parameters and optimizer state from a live
peer (:mod:`engine.ft.state`), not from disk. :mod:`engine.ft.replica` is one replica's step
loop, :mod:`engine.ft.harness` runs three of them, kills one and restarts it, and recomputes
the run in one process.
"""

from engine.ft.quorum import Quorum, QuorumClient
from engine.ft.group import QuorumGroup
from engine.ft.state import pack_state, unpack_state
from engine.ft.replica import FaultTolerantReplica
from engine.ft.harness import FailureRun, check_replica_groups, reference_run, run_with_failure
from engine.ft.interval import best_interval, simulate_wall_time

__all__ = ["Quorum", "QuorumClient", "QuorumGroup", "pack_state", "unpack_state",
           "FaultTolerantReplica", "FailureRun", "run_with_failure", "reference_run",
           "check_replica_groups", "simulate_wall_time", "best_interval"]
