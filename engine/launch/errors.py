"""What a failed launch raises, and how a rank's failure is told apart from its symptoms.

The errors: :class:`LaunchError` and its three kinds, a rank that raised (:class:`RankError`),
one that died without a word (:class:`RankDiedError`) and one that never finished
(:class:`RankTimeoutError`).

The classification: when one rank fails, its peers fail too, a moment later and for no fault
of their own: a collective that lost its peer ("connection closed by peer") or waited for it
past the process group's timeout. :func:`is_symptom` tells such a failure from a cause, so the
supervisor (:mod:`engine.launch.supervisor`) names the rank at fault, and
:func:`says_peer_is_missing` reads the same signs in an error's text for
:mod:`engine.launch.elastic`, which names the lost peers under torchrun.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# After a symptom (a timeout, a lost peer), how long the supervisor listens for its cause.
GATHER_S = 1.0


class LaunchError(RuntimeError):
    """A launch failed: ``ranks`` names the rank(s) at fault, ``outputs`` what each printed."""

    def __init__(self, message: str, ranks: list[int], outputs: dict[int, str] | None = None):
        super().__init__(message)
        self.ranks = ranks
        self.rank = ranks[0] if ranks else None
        self.outputs = outputs or {}


class RankError(LaunchError):
    """A rank raised. ``exc_type`` and ``traceback`` are the original exception's, as text."""

    def __init__(self, rank, exc_type, exc_message, tb, outputs=None):
        super().__init__(
            f"rank {rank} raised {exc_type}: {exc_message}\n\n"
            f"--- original traceback from rank {rank} ---\n{tb.rstrip()}",
            [rank],
            outputs,
        )
        self.exc_type = exc_type
        self.traceback = tb


class RankDiedError(LaunchError):
    """A rank exited (``os._exit``, a signal, the OOM killer) without returning or raising."""


class RankTimeoutError(LaunchError):
    """A rank was still running when the deadline or the process-group timeout passed."""


@dataclass
class Failure:
    """One rank's failure as the supervisor saw it: it ``raised`` (its exception's type,
    message, traceback and, when it pickles, the exception itself) or ``died`` (its exit
    code)."""

    rank: int
    kind: str  # "raised" | "died"
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    exc_blob: bytes | None = None
    exitcode: int | None = None
    watchdog: bool = False  # died: NCCL's watchdog aborted it, a collective having timed out
    seen_at: float = field(default_factory=time.monotonic)


# What torch.distributed raises when a peer is missing (Gloo, NCCL and the store). A user's own
# TimeoutError is not among them, so it is reported as the real failure it is.
DIST_ERRORS = (
    "RuntimeError", "DistError", "DistBackendError", "DistStoreError", "DistNetworkError",
)

# What NCCL's watchdog prints before it aborts a rank whose collective ran past the timeout.
WATCHDOG = "Watchdog caught collective operation timeout"

# What Gloo, NCCL and the store say when a peer never answered within the group's timeout...
TIMEOUT_SIGNS = ("timed out", "timeout")
# ... and when the process at the other end of a connection is gone.
PEER_LOSS_SIGNS = ("connection closed by peer", "connection reset by peer", "broken pipe")


def says_timeout(text: str) -> bool:
    """``text`` (an error's message) says a wait ran past its timeout."""
    return any(sign in text.lower() for sign in TIMEOUT_SIGNS)


def says_peer_lost(text: str) -> bool:
    """``text`` says the process at the other end of a connection is gone."""
    return any(sign in text.lower() for sign in PEER_LOSS_SIGNS)


def says_peer_is_missing(text: str) -> bool:
    """``text`` is a collective's error for want of a peer: lost, or timed out waiting."""
    return says_timeout(text) or says_peer_lost(text)


def looks_like_timeout(failure: Failure) -> bool:
    """The rank timed out in a collective (or NCCL's watchdog aborted it for that)."""
    return failure.watchdog or (
        failure.kind == "raised" and failure.exc_type in DIST_ERRORS
        and says_timeout(failure.message)
    )


def looks_like_peer_loss(failure: Failure) -> bool:
    """The rank's collective failed because the peer's process is gone."""
    return (failure.kind == "raised" and failure.exc_type in DIST_ERRORS
            and says_peer_lost(failure.message))


def is_symptom(failure: Failure) -> bool:
    """Raised only because another rank failed: a lost connection or a timeout."""
    return looks_like_timeout(failure) or looks_like_peer_loss(failure)


def settled(failures: list[Failure]) -> bool:
    """Stop supervising at the first real failure. A symptom (a lost peer, a timeout) often
    arrives a moment before its cause, so then keep listening ``GATHER_S`` for the cause."""
    if not failures:
        return False
    if not all(is_symptom(f) for f in failures):
        return True
    return time.monotonic() - failures[0].seen_at > GATHER_S
