"""The supervisor: one local launch, from the parent's side. Start the ranks, watch them,
collect what each returns, turn the first real failure into an error, and clean up.

Each rank runs :func:`engine.launch.rank.rank_main` in its own process (and its own process
group), a keeper whose worker runs ``fn`` and sends one message down a pipe; the keeper ends as
its worker did. The supervisor waits on every pipe and every process at once, so a rank that
raises, dies without a word (``os._exit``, a signal) or stays stuck past the deadline is seen
at once. A rank that failed because a peer did (a lost
connection, a collective's timeout: :func:`engine.launch.errors.is_symptom`) is not the rank
at fault: the report names the rank that raised or died first, or else the one that never
joined. Every rank is killed and reaped before the error is raised, on success and on Ctrl-C
too, so nothing is left behind and the kernel stays usable: each keeper first ends everything
its rank started, however it detached (:mod:`engine.launch.reaper`).

The ranks meet through a ``FileStore`` in the launch's own directory (mode 0700, removed at the
end): no port to listen on, and no other user can reach it (:func:`engine.launch.rank.
rendezvous`).

Each launch keeps its bookkeeping in its own :class:`Launch`; the module holds no state.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import wait as wait_for_any
from typing import Any, Callable

from engine.launch.errors import (
    WATCHDOG,
    Failure,
    LaunchError,
    RankDiedError,
    RankError,
    RankTimeoutError,
    is_symptom,
    looks_like_timeout,
    settled,
)
from engine.launch.rank import rank_main

DEADLINE_GRACE_S = 3.0  # the parent's deadline falls this long after the group's timeout
KEEPER_GRACE_S = 5.0  # how long a rank's keeper may take to end its rank before SIGKILL


class Launch:
    """One local launch: ``run()`` starts the ranks, supervises them and returns their
    results in rank order, or raises the :class:`LaunchError` that names the rank at fault."""

    def __init__(self, fn: Callable[..., Any], world_size: int, args: tuple, backend: str,
                 timeout: float, start_method: str, quiet: bool, deadline: bool = True):
        self.fn, self.n, self.args, self.deadline = fn, world_size, args, deadline
        self.backend, self.timeout, self.quiet = backend, float(timeout), quiet
        self.ctx = mp.get_context(start_method)
        # mode 0700: the ranks' output and the rendezvous store are this user's alone
        self.tmpdir = tempfile.mkdtemp(prefix="engine-launch-")
        self.store_path = os.path.join(self.tmpdir, "store")
        self.procs: list[mp.process.BaseProcess] = []
        self.finished: set[int] = set()  # ranks that returned a result
        self.conns: list[Any] = []

    def run(self) -> list[Any]:
        try:
            with sigint_deferred():  # a Ctrl-C mid-fork must not leave an untracked rank
                self._start()
            return self._supervise()
        finally:  # success, a rank's failure, or Ctrl-C: nothing outlives the launch
            with sigint_deferred():
                self._kill_all()
                self._print_outputs()
                shutil.rmtree(self.tmpdir, ignore_errors=True)

    # -- start ---------------------------------------------------------------------------------

    def _start(self) -> None:
        for rank in range(self.n):
            reader, writer = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(
                target=rank_main,
                name=f"engine-rank-{rank}",
                args=(
                    self.fn,
                    rank,
                    self.n,
                    self.args,
                    self.backend,
                    self.timeout,
                    self.store_path,
                    self._out_path(rank),
                    writer,
                ),
            )
            proc.start()
            try:  # the rank does this too; whoever is first closes the race with _kill_all
                os.setpgid(proc.pid, proc.pid)
            except OSError:  # already done, or a spawned rank that has exec'd
                pass
            writer.close()
            self.procs.append(proc)
            self.conns.append(reader)

    def _out_path(self, rank: int) -> str:
        return os.path.join(self.tmpdir, f"rank{rank}.log")

    # -- supervise -----------------------------------------------------------------------------

    def _supervise(self) -> list[Any]:
        # The process group times out first, so ranks blocked in a collective report a timeout
        # and the parent can tell them apart from the rank that never came (see _failure_error).
        deadline = time.monotonic() + self.timeout + DEADLINE_GRACE_S if self.deadline else \
            math.inf  # a long run: only its collectives' timeout bounds a wait
        results: dict[int, Any] = {}
        failures: list[Failure] = []
        waiting = set(range(self.n))  # ranks whose message (result or error) has not come yet
        while waiting and not settled(failures):
            left = deadline - time.monotonic()
            if left <= 0:
                if failures:
                    break
                raise self._stuck_error(sorted(waiting), cause=None)
            watch = {self.conns[r]: r for r in waiting}
            watch.update({self.procs[r].sentinel: r for r in waiting})
            for ready in wait_for_any(list(watch), timeout=min(left, 0.25)):
                rank = watch[ready]
                if rank not in waiting:
                    continue
                message = self._read_message(rank)
                if message is None:  # the process ended without sending anything
                    if ready is self.procs[rank].sentinel:
                        failures.append(self._died(rank))
                        waiting.discard(rank)
                    continue
                waiting.discard(rank)
                status, payload = message
                if status == "ok":
                    results[rank] = payload
                    self.finished.add(rank)
                else:
                    failures.append(Failure(rank, "raised", **payload))
        if failures:
            raise self._failure_error(failures, still_running=sorted(waiting))
        # Every rank has answered; give each a moment to exit on its own (_kill_all reaps).
        exit_by = time.monotonic() + 5.0
        for proc in self.procs:
            wait_for_any([proc.sentinel], timeout=max(0.0, exit_by - time.monotonic()))
        return [results[r] for r in range(self.n)]

    def _died(self, rank: int) -> Failure:
        """A rank that ended without a word. On NCCL a collective that times out does not raise:
        the watchdog thread aborts the process, after printing why. That rank was waiting for
        another, so it is a symptom like a timeout, not the rank at fault."""
        self.procs[rank].join()
        failure = Failure(rank, "died", exitcode=self.procs[rank].exitcode)
        said = [line for line in self._output(rank).splitlines() if WATCHDOG in line]
        if said:
            failure.watchdog = True
            failure.message = failure.traceback = said[0].strip()
        return failure

    def _read_message(self, rank: int):
        conn = self.conns[rank]
        try:
            if not conn.poll():
                return None
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return None
        try:
            return pickle.loads(data)
        except Exception as e:
            return "error", dict(
                exc_type=type(e).__name__,
                message=f"its return value could not be unpickled by the caller: {e}",
                traceback=traceback.format_exc(),
                exc_blob=None,
            )

    # -- errors --------------------------------------------------------------------------------

    def _failure_error(self, failures: list[Failure], still_running: list[int]) -> LaunchError:
        # A rank that lost a peer, or timed out waiting for one, is a symptom; the root cause is
        # the rank that raised or died first, or else the peer that never answered.
        failure = next((f for f in failures if not is_symptom(f)), None)
        alive = [r for r in still_running if self.procs[r].is_alive()]
        timed_out = [f.rank for f in failures if looks_like_timeout(f)]
        if failure is None and alive and timed_out:
            return self._stuck_error(alive, cause=failures[0])
        if failure is None and timed_out and len(failures) == self.n:
            # every rank failed waiting: timed out, or lost a peer that timed out (a rank the
            # watchdog aborts first takes its peers' connections with it)
            return self._stuck_error(sorted(f.rank for f in failures), cause=failures[0],
                                     deadlock=True)
        if failure is None and self.finished:  # a peer returned while others still needed it
            failures[0].message += (
                f" (rank{'s' if len(self.finished) > 1 else ''} "
                f"{', '.join(map(str, sorted(self.finished)))} had already returned: "
                "is every send matched by a receive on the peer?)"
            )
        failure = failure or failures[0]
        self._kill_all()
        outputs = self._outputs()
        if failure.kind == "died":
            code = failure.exitcode
            how = (
                f"was killed by signal {signal.Signals(-code).name}"
                if code and code < 0
                else f"exited with code {code} without returning a result"
            )
            said = f": {failure.message}" if failure.message else ""
            last = last_lines(outputs.get(failure.rank, ""))
            if last and not failure.message:  # what it printed last, often why (an abort's
                said = f"; its last output:\n{indent(last)}"  # "what(): ...", even when quiet)
            return RankDiedError(f"rank {failure.rank} {how}{said}", [failure.rank], outputs)
        error = RankError(
            failure.rank, failure.exc_type, failure.message, failure.traceback, outputs
        )
        if failure.exc_blob is not None:
            try:
                error.__cause__ = pickle.loads(failure.exc_blob)
            except Exception:  # the exception type may not exist in this process
                pass
        return error

    def _stuck_error(
        self, ranks: list[int], cause: Failure | None, deadlock: bool = False
    ) -> RankTimeoutError:
        self._kill_all()
        outputs = self._outputs()
        names = ", ".join(str(r) for r in ranks)
        why = (
            "deadlock: every rank was waiting for another; is every send matched by a "
            "receive on the peer, in the same order?"
            if deadlock
            else "stuck: alive but never joined its peers"
        )
        message = (
            f"rank{'s' if len(ranks) > 1 else ''} {names} did not finish within "
            f"{self.timeout:g} s ({why}); all ranks were stopped"
        )
        if cause is not None:
            message += (
                f".\nrank {cause.rank} timed out waiting for them:\n"
                f"{indent(cause.traceback.rstrip())}"
            )
        return RankTimeoutError(message, ranks, outputs)

    # -- clean up and output -------------------------------------------------------------------

    def _kill_all(self) -> None:
        # First ask each keeper to end its rank and whatever the rank started (SIGTERM); a
        # keeper that has not done so in KEEPER_GRACE_S is killed with the rest below.
        asked = []
        for proc in self.procs:
            if proc.pid is not None and proc.exitcode is None:
                try:
                    os.kill(proc.pid, signal.SIGTERM)
                    asked.append(proc)
                except ProcessLookupError:
                    pass
        give_up = time.monotonic() + KEEPER_GRACE_S
        for proc in asked:
            wait_for_any([proc.sentinel], timeout=max(0.0, give_up - time.monotonic()))
        for proc in self.procs:
            if proc.pid is None:
                continue
            try:  # each rank leads its own process group: anything it started goes with it,
                os.killpg(proc.pid, signal.SIGKILL)  # even after the rank itself has exited
            except (ProcessLookupError, PermissionError):
                pass
            proc.kill()  # the rank itself, in case it had not yet made its group
        for proc in self.procs:
            proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.conns = []

    def _output(self, rank: int) -> str:
        try:
            with open(self._out_path(rank), errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def _outputs(self) -> dict[int, str]:
        return {rank: self._output(rank) for rank in range(self.n)}

    def _print_outputs(self) -> None:
        if self.quiet:
            return
        for rank, text in self._outputs().items():
            for line in text.splitlines():
                print(f"[rank {rank}] {line}")


FATAL = "Fatal Python error:"  # how faulthandler starts its dump of a dying process's stacks


def last_lines(text: str, n: int = 6) -> str:
    """What a rank that died printed last: its last ``n`` non-empty lines. When faulthandler
    dumped its stacks (a rank inherits it from a launching process that enabled it, as pytest
    does), the lines before the dump (an abort's ``what(): ...``), the dump's first line, and
    the innermost frame of the thread that died."""
    before, fatal, dump = text.rpartition(FATAL)
    if not fatal:
        before, dump = text, ""
    lines = [line for line in before.splitlines() if line.strip()][-n:]
    if fatal:
        dumped = dump.splitlines()
        lines.append(FATAL + dumped[0])
        current = next((i for i, line in enumerate(dumped) if line.startswith("Current thread")),
                       len(dumped))
        frame = next((line for line in dumped[current:] if line.strip().startswith("File")), None)
        if frame:
            lines.append(frame.strip() + " (innermost)")
    return "\n".join(lines)


def indent(text: str, prefix: str = "    ") -> str:
    """``text`` with every line indented; a placeholder for no text at all."""
    return "\n".join(prefix + line for line in text.splitlines()) or prefix + "(no output)"


@contextlib.contextmanager
def sigint_deferred():
    """Hold off Ctrl-C while ranks are forked or torn down, then deliver it.

    A KeyboardInterrupt landing between ``fork()`` and the bookkeeping that records the child
    would leave an untracked rank running. Python raises KeyboardInterrupt only in the main
    thread, so only there is there anything to defer.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(signal.SIGINT, None)  # e.g. default_int_handler: raise KeyboardInterrupt
        elif caught and previous == signal.SIG_DFL:
            raise KeyboardInterrupt
