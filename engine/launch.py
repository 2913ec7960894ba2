"""Start ``world_size`` ranks in a real process group and collect what each returns.

``launch(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on every rank inside an
initialised ``torch.distributed`` process group and returns the return values in rank order.

Which backend, and how ranks start:

* **Gloo, the default on every machine: fork.** ``backend="auto"`` means Gloo, with or without
  GPUs, so a lesson written for the CPU runs the same on a laptop and on an 8-GPU node. Forked
  ranks start in a fraction of a second (spawn re-imports torch in every rank, several seconds
  each; ``benchmarks/launch.py`` measures both), and a function defined in a notebook cell
  works, since nothing is pickled. Every rank calls ``torch.set_num_threads(1)`` before its
  first op: a child forked from a parent that already ran an OpenMP op can otherwise hang. The
  first launch imports ``torch._dynamo`` (which the first optimizer step needs) in the parent,
  so forked ranks inherit it instead of each importing it again.
* **NCCL, only when asked for: spawn**, one GPU per rank, each bound to ``cuda:LOCAL_RANK``
  (:mod:`engine.device`). ``fn`` must be importable (defined at module level in a file).
* **CUDA in a forked rank** works only if the parent never touched CUDA: once the parent has
  called ``torch.cuda.is_available()`` (or anything that initialises the CUDA driver), a forked
  child cannot. The Gloo path of ``launch`` asks CUDA nothing, and a rank that hits the error
  is told to use ``start_method="spawn"``.
* **Under torchrun** (``RANK`` and ``WORLD_SIZE`` set) ``fn`` runs in the current process, so a
  lab script is the same code on one node or many. Every process makes the same backend
  decision: it depends on the arguments and on ``LOCAL_WORLD_SIZE``, never on ``LOCAL_RANK``.

Rank 0 hosts the rendezvous store on a port the operating system picks (port 0), and passes the
number to its siblings, so two notebooks launching at once never collide.

When something goes wrong the caller gets a :class:`LaunchError` naming the rank, never a hang:
a rank that raises (its original traceback is carried along), a rank that dies without a word
(``os._exit``, a signal), a rank that is stuck past the deadline, or a Ctrl-C / kernel
interrupt. A rank that NCCL's watchdog aborted because a collective timed out is a symptom,
not the cause: the report names the rank that never joined. Every rank is killed and reaped
before the error is raised, so nothing is left behind and the kernel stays usable.

The module holds no mutable state: importing it starts nothing, and each launch keeps its
bookkeeping in its own :class:`_Launch`.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import io
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait as wait_for_any
from typing import Any, Callable

import torch
import torch.distributed as dist

from engine.device import local_gpu, local_rank
from engine.validation import one_of, positive_int, positive_number

BACKENDS = ("auto", "gloo", "nccl")
DEFAULT_TIMEOUT_S = 300.0
_DEADLINE_GRACE_S = 3.0  # the parent's deadline falls this long after the group's timeout
_GATHER_S = 1.0  # after a symptom (timeout, lost peer), how long to listen for its cause
_HOST = "127.0.0.1"


# --------------------------------------------------------------------------------------------
# Errors


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


# --------------------------------------------------------------------------------------------
# Public entry point


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT_S,
    start_method: str | None = None,
    quiet: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return results in rank order.

    Args:
        fn: the per-rank function. With fork (Gloo's default) it may be defined anywhere,
            including a notebook cell; with spawn (NCCL) it must be importable.
        world_size: number of ranks, at least 1.
        backend: ``"gloo"`` or ``"auto"`` (the same: Gloo on any machine), or ``"nccl"``
            (one GPU per rank, asked for explicitly).
        timeout: seconds. The process group's timeout: a rank blocked longer than this in one
            collective raises. A few seconds later comes the parent's deadline, after which any
            rank still running is reported as stuck and every rank is killed.
        start_method: ``"fork"`` or ``"spawn"``; by default fork for Gloo and spawn for NCCL.
            Gloo ranks that use CUDA need spawn once this process has touched CUDA.
        quiet: do not print the ranks' captured output (it is still on a raised error).

    Returns:
        ``[result_of_rank_0, result_of_rank_1, ...]``. CUDA tensors come back on the CPU.

    Raises:
        ValueError: bad arguments, before any process starts.
        RankError / RankDiedError / RankTimeoutError (all :class:`LaunchError`): a rank failed.
    """
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {fn!r} of type {type(fn).__name__}")
    positive_int("world_size", world_size)
    one_of("backend", backend, BACKENDS)
    positive_number("timeout (seconds)", timeout)
    one_of("start_method", start_method, (None, "fork", "spawn"))

    if _under_torchrun():
        return _run_in_this_process(fn, world_size, args, backend, timeout)

    backend = resolve_backend(backend, world_size)
    start_method = start_method or ("spawn" if backend == "nccl" else "fork")
    if start_method == "spawn":
        _check_picklable(fn, args)
    else:
        _preimport()
    return _Launch(fn, world_size, args, backend, timeout, start_method, quiet).run()


def resolve_backend(backend: str, ranks_here: int, ranks_name: str = "world_size") -> str:
    """``"auto"`` -> Gloo, on any machine; ``"nccl"`` -> NCCL, once checked that this machine
    has a GPU for each of its ``ranks_here`` ranks (``ranks_name`` says where that number came
    from, for the message). Asks CUDA nothing unless NCCL was asked for."""
    if backend in ("auto", "gloo"):
        return "gloo"
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_gpus == 0:
        raise ValueError(
            "backend='nccl' needs CUDA GPUs, and this machine has none; "
            "use backend='gloo' (or 'auto') to run on the CPU"
        )
    if not dist.is_nccl_available():
        raise ValueError("backend='nccl': this build of torch has no NCCL; use backend='gloo'")
    if ranks_here > n_gpus:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: {ranks_name}={ranks_here} but only "
            f"{n_gpus} GPU(s) are visible. Use backend='gloo' for more ranks than GPUs."
        )
    return backend


def is_global_rank_zero() -> bool:
    """True in the one process that should print a report or write a file: global rank 0 of
    the process group, or of the launch that started this process (``RANK``, which torchrun
    and :func:`launch` set), or a process that is no rank at all. It still answers after the
    process group is destroyed, so code that reports after ``launch`` returns can use it."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


# --------------------------------------------------------------------------------------------
# torchrun: the current process is already one rank


def _under_torchrun() -> bool:
    """True when torchrun (or a scheduler doing as it does) started this process as one rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _run_in_this_process(fn, world_size, args, backend, timeout):
    env_world = int(os.environ["WORLD_SIZE"])
    if world_size != env_world:
        raise ValueError(
            f"world_size={world_size} but this process was started with WORLD_SIZE={env_world} "
            "(torchrun --nproc-per-node x --nnodes); pass the same number"
        )
    rank = int(os.environ["RANK"])
    created = not dist.is_initialized()
    if created:
        # The same numbers on every process of a node, so every rank decides alike.
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank() + 1))
        backend = resolve_backend(backend, ranks_here, "LOCAL_WORLD_SIZE")
        _init_process_group(backend, timeout)  # env:// rendezvous, as torchrun set it up
    try:
        result = _to_cpu(fn(rank, world_size, *args))
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, result)
        return gathered
    finally:
        if created:
            dist.destroy_process_group()


def _init_process_group(backend: str, timeout: float, **rendezvous) -> None:
    """Join the group; an NCCL rank first binds its GPU and names it to the group, so no
    collective (the first barrier included) has to guess which GPU this rank uses."""
    device_id = None
    if backend == "nccl":
        device_id = local_gpu()
        torch.cuda.set_device(device_id)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout), device_id=device_id,
                            **rendezvous)


# --------------------------------------------------------------------------------------------
# One local launch: start ranks, supervise them, collect results, clean up


@dataclass
class _Failure:
    rank: int
    kind: str  # "raised" | "died"
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    exc_blob: bytes | None = None
    exitcode: int | None = None
    watchdog: bool = False  # died: NCCL's watchdog aborted it, a collective having timed out
    seen_at: float = field(default_factory=time.monotonic)


class _Launch:
    def __init__(self, fn, world_size, args, backend, timeout, start_method, quiet):
        self.fn, self.n, self.args = fn, world_size, args
        self.backend, self.timeout, self.quiet = backend, float(timeout), quiet
        self.ctx = mp.get_context(start_method)
        self.tmpdir = tempfile.mkdtemp(prefix="engine-launch-")
        self.procs: list[mp.process.BaseProcess] = []
        self.finished: set[int] = set()  # ranks that returned a result
        self.conns: list[Any] = []

    def run(self) -> list[Any]:
        try:
            with _sigint_deferred():  # a Ctrl-C mid-fork must not leave an untracked rank
                self._start()
            return self._supervise()
        finally:  # success, a rank's failure, or Ctrl-C: nothing outlives the launch
            with _sigint_deferred():
                self._kill_all()
                self._print_outputs()
                shutil.rmtree(self.tmpdir, ignore_errors=True)

    # -- start ---------------------------------------------------------------------------------

    def _start(self) -> None:
        # Kept on self: spawned ranks unpickle these after _start returns.
        self.port = port = self.ctx.Value("i", 0)
        self.port_ready = port_ready = self.ctx.Event()
        for rank in range(self.n):
            reader, writer = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(
                target=_rank_main,
                name=f"engine-rank-{rank}",
                args=(
                    self.fn,
                    rank,
                    self.n,
                    self.args,
                    self.backend,
                    self.timeout,
                    port,
                    port_ready,
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
        deadline = time.monotonic() + self.timeout + _DEADLINE_GRACE_S
        results: dict[int, Any] = {}
        failures: list[_Failure] = []
        waiting = set(range(self.n))  # ranks whose message (result or error) has not come yet
        while waiting and not _settled(failures):
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
                    failures.append(_Failure(rank, "raised", **payload))
        if failures:
            raise self._failure_error(failures, still_running=sorted(waiting))
        # Every rank has answered; give each a moment to exit on its own (_kill_all reaps).
        exit_by = time.monotonic() + 5.0
        for proc in self.procs:
            wait_for_any([proc.sentinel], timeout=max(0.0, exit_by - time.monotonic()))
        return [results[r] for r in range(self.n)]

    def _died(self, rank: int) -> _Failure:
        """A rank that ended without a word. On NCCL a collective that times out does not raise:
        the watchdog thread aborts the process, after printing why. That rank was waiting for
        another, so it is a symptom like a timeout, not the rank at fault."""
        self.procs[rank].join()
        failure = _Failure(rank, "died", exitcode=self.procs[rank].exitcode)
        said = [line for line in self._output(rank).splitlines() if _WATCHDOG in line]
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

    def _failure_error(self, failures: list[_Failure], still_running: list[int]) -> LaunchError:
        # A rank that lost a peer, or timed out waiting for one, is a symptom; the root cause is
        # the rank that raised or died first, or else the peer that never answered.
        failure = next((f for f in failures if not _is_symptom(f)), None)
        alive = [r for r in still_running if self.procs[r].is_alive()]
        timed_out = [f.rank for f in failures if _looks_like_timeout(f)]
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
        self, ranks: list[int], cause: _Failure | None, deadlock: bool = False
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
                f"{_indent(cause.traceback.rstrip())}"
            )
        return RankTimeoutError(message, ranks, outputs)

    # -- clean up and output -------------------------------------------------------------------

    def _kill_all(self) -> None:
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


# What torch.distributed raises when a peer is missing (Gloo, NCCL and the store). A user's own
# TimeoutError is not among them, so it is reported as the real failure it is.
_DIST_ERRORS = (
    "RuntimeError", "DistError", "DistBackendError", "DistStoreError", "DistNetworkError",
)


# What NCCL's watchdog prints before it aborts a rank whose collective ran past the timeout.
_WATCHDOG = "Watchdog caught collective operation timeout"


def _looks_like_timeout(failure: _Failure) -> bool:
    text = failure.message.lower()
    return failure.watchdog or (
        failure.kind == "raised"
        and failure.exc_type in _DIST_ERRORS
        and ("timed out" in text or "timeout" in text)
    )


def _looks_like_peer_loss(failure: _Failure) -> bool:
    text = failure.message.lower()
    return failure.kind == "raised" and failure.exc_type in _DIST_ERRORS and any(
        m in text for m in ("connection closed by peer", "connection reset by peer",
                            "broken pipe"))


def _is_symptom(failure: _Failure) -> bool:
    """Raised only because another rank failed: a lost connection or a timeout."""
    return _looks_like_timeout(failure) or _looks_like_peer_loss(failure)


def _settled(failures: list[_Failure]) -> bool:
    """Stop supervising at the first real failure. A symptom (a lost peer, a timeout) often
    arrives a moment before its cause, so then keep listening ``_GATHER_S`` for the cause."""
    if not failures:
        return False
    if not all(_is_symptom(f) for f in failures):
        return True
    return time.monotonic() - failures[0].seen_at > _GATHER_S


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines()) or prefix + "(no output)"


# --------------------------------------------------------------------------------------------
# Inside one rank


def _rank_main(fn, rank, world_size, args, backend, timeout, port, port_ready, out_path, conn):
    """Body of every rank process: isolate, capture output, join the group, run ``fn``, report."""
    os.setpgid(0, 0)  # our own process group: the parent can kill us and anything we started
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _capture_output(out_path)
    torch.set_num_threads(1)
    code = 0
    try:
        store = _rendezvous(rank, world_size, timeout, port, port_ready)
        os.environ.update(  # as torchrun sets them; engine.device and is_global_rank_zero read
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR=_HOST,
            MASTER_PORT=str(port.value),
        )
        _init_process_group(backend, timeout, store=store, rank=rank, world_size=world_size)
        result = _to_cpu(fn(rank, world_size, *args))
        try:
            message = pickle.dumps(("ok", result))
        except Exception as e:
            raise TypeError(
                f"rank {rank} returned a value that cannot be sent back to the caller "
                f"({type(e).__name__}: {e}); return plain Python values, "
                "tensors, or lists and dicts of them"
            ) from e
        if dist.is_initialized():  # fn may have torn the group down itself
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - everything a rank raises goes to the caller
        code = 1
        try:
            blob = pickle.dumps(e)
        except Exception:
            blob = None
        tb = e.__traceback__.tb_next or e.__traceback__  # from fn down, without this frame
        message = pickle.dumps(
            (
                "error",
                dict(
                    exc_type=type(e).__name__,
                    message=_explain(e),
                    traceback="".join(traceback.format_exception(type(e), e, tb)),
                    exc_blob=blob,
                ),
            )
        )
    try:
        sys.stdout.flush()  # all output is in the file before the parent hears back
        sys.stderr.flush()
        conn.send_bytes(message)
    finally:
        os._exit(code)  # skip atexit handlers inherited from the parent (Jupyter, torch)


def _safe_str(e: BaseException) -> str:
    try:
        return str(e)
    except Exception as inner:
        return f"<str() of the exception failed: {type(inner).__name__}: {inner}>"


# What torch raises when a forked child uses CUDA after its parent initialised the driver.
_FORKED_CUDA = "Cannot re-initialize CUDA in forked subprocess"


def _explain(e: BaseException) -> str:
    """The exception's message, with what to do when it is one the launch itself explains."""
    text = _safe_str(e)
    if _FORKED_CUDA in text:
        text += (
            "\nThis rank was forked (Gloo's default start) from a process that had already "
            "initialised CUDA; calling torch.cuda.is_available() or device_count() is enough, "
            "and a forked child can then not use CUDA at all. For CUDA tensors on Gloo, launch "
            "with start_method='spawn' and fn defined at module level in a .py file; a lesson "
            "that stays on the CPU needs no change."
        )
    return text


def _rendezvous(rank, world_size, timeout, port, port_ready) -> dist.Store:
    """Rank 0 serves the store on a port the OS picks and tells the others its number."""
    wait = timedelta(seconds=timeout)
    if rank == 0:
        store = dist.TCPStore(
            _HOST, 0, world_size, is_master=True, wait_for_workers=False, timeout=wait
        )
        port.value = store.port
        port_ready.set()
        return store
    if not port_ready.wait(timeout):
        raise TimeoutError(f"rank {rank}: rank 0 did not start its store within {timeout:g} s")
    return dist.TCPStore(_HOST, port.value, world_size, is_master=False, timeout=wait)


def _capture_output(path: str) -> None:
    """Send this process's stdout and stderr (Python and C level) to ``path``, in order."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # A notebook's sys.stdout talks to the kernel over ZeroMQ, which does not survive a fork.
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True)
    if faulthandler.is_enabled():  # (pytest enables it) its dumps go to this rank's output too
        faulthandler.enable(file=sys.stderr)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank if the parent dies first (no orphans, even on kill -9)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _to_cpu(value):
    """Move tensors in (nested lists/tuples/dicts of) ``value`` to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.cpu() if value.device.type != "cpu" else value
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------------------------
# Parent-side helpers


@contextlib.contextmanager
def _sigint_deferred():
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


def _preimport() -> None:
    """Import what every rank needs once, in the parent, so forked ranks inherit it.

    The first optimizer step pulls in ``torch._dynamo`` (over a second on a small CPU);
    imported in the parent before the first fork, each forked rank gets it for free. Not done
    at ``import engine``, which must stay cheap (``engine.theory`` is pure formulas).
    """
    import torch._dynamo  # noqa: F401
    import torch.optim  # noqa: F401


def _check_picklable(fn, args) -> None:
    try:
        pickle.dumps((fn, args))
    except Exception as e:
        raise ValueError(
            f"with start_method='spawn' (NCCL's, or asked for) fn and its arguments must be "
            f"picklable: "
            f"{fn!r} is not ({type(e).__name__}: {e}). Define fn at module level in a .py file, "
            "or use backend='gloo' to fork, which accepts functions defined in a notebook."
        ) from e

