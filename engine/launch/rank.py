"""The rank body: what each process :func:`engine.launch` starts does, from birth to exit.

The process the launch starts is the rank's *keeper*: it isolates itself (its own process
group, killed with its parent, Ctrl-C left to the parent), sends its output to a file the
parent prints afterwards, becomes the subreaper of everything below it
(:mod:`engine.launch.reaper`) and forks the rank's *worker*. The worker meets its siblings
through the launch's rendezvous store (a ``FileStore`` in the launch's private directory, see
:func:`rendezvous`), joins the process group over loopback, runs ``fn`` and sends back one
message: ``("ok", result)`` or ``("error", what it raised)``. It never returns: it exits with
``os._exit``, skipping the atexit handlers it inherited from the parent (Jupyter, torch).

The keeper waits for the worker, kills whatever the rank started that is still alive, however
it detached (a double fork, ``os.setsid()``), and exits as the worker did: the same exit code,
or the same signal, so the parent reads the worker's end from the keeper's. Asked to stop
(SIGTERM: the launch is being torn down, or the launching process died), it kills the worker
and everything below it first.
"""

from __future__ import annotations

import ctypes
import faulthandler
import io
import os
import pickle
import signal
import socket
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.launch.backend import init_process_group
from engine.launch.env import LaunchEnv
from engine.launch.reaper import become_subreaper, end_descendants, has_children

HOST = "127.0.0.1"  # where a store served by store_main listens, and nowhere else

# What torch raises when a forked child uses CUDA after its parent initialised the driver.
FORKED_CUDA = "Cannot re-initialize CUDA in forked subprocess"


def rank_main(fn, rank, world_size, args, backend, timeout, store_path, out_path, conn):
    """Body of every rank's process, the keeper: isolate, capture output, fork the worker
    (:func:`run_rank`), and once it has ended, end everything it started (:func:`keep`)."""
    # SIGTERM (the launch tears down) and SIGCHLD are taken by sigwaitinfo in keep, never by
    # a handler: held from the start, none is lost, and none interrupts the clean-up.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, KEEPER_SIGNALS)
    os.setpgid(0, 0)  # our own process group: the parent can kill us and anything we started
    die_with_parent(signal.SIGTERM)  # as asked to stop: the keeper first ends what is below it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    capture_output(out_path)
    become_subreaper()
    keeper = os.getpid()
    worker = os.fork()
    if worker == 0:
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # fn's signals as they were
            die_with_parent()
            if os.getppid() == keeper:  # else the keeper died before the line above took effect
                run_rank(fn, rank, world_size, args, backend, timeout, store_path, conn)
        finally:  # run_rank exits by itself; the worker never runs the keeper's code
            os._exit(1)
    conn.close()  # the worker's to write; the parent reads it
    keep(worker)


KEEPER_SIGNALS = {signal.SIGTERM, signal.SIGCHLD}


def keep(worker: int) -> None:
    """The keeper's life once the worker is forked: reap every child until the worker ends
    (or SIGTERM asks to stop), kill what is left below, and exit as the worker did."""
    status = None
    while status is None:
        if signal.sigwaitinfo(KEEPER_SIGNALS).si_signo == signal.SIGTERM:
            break
        while True:  # SIGCHLD: the worker, or an orphan re-parented here, ended
            try:
                pid, code = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid = 0
            if pid == 0:
                break
            if pid == worker:
                status = code
    if status is None:
        try:
            os.kill(worker, signal.SIGKILL)
            os.waitpid(worker, 0)
        except (ProcessLookupError, ChildProcessError):  # gone and reaped already
            pass
    if has_children():  # else nothing is below: whatever the worker started was handed here
        end_descendants()
    if status is None:  # stopped: the launch no longer listens
        os._exit(1)
    if os.WIFSIGNALED(status):  # die by the worker's signal, so the parent names it
        signum = os.WTERMSIG(status)
        faulthandler.disable()  # the keeper's own stack would say nothing about the rank
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(
                resource.RLIMIT_CORE)[1]))  # the worker dumped its core if it was to
            signal.signal(signum, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL and SIGSTOP keep their default anyway
            pass
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)  # a signal whose default is not to end a process
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def run_rank(fn, rank, world_size, args, backend, timeout, store_path, conn):
    """Body of every rank's worker: join the group, run ``fn``, report, exit."""
    torch.set_num_threads(1)
    code, message = 0, b""
    try:
        loopback_only()
        store = rendezvous(store_path, timeout)
        # as torchrun sets them, for fn's own code and any process it starts (no MASTER_ADDR
        # or MASTER_PORT: the store is a file)
        LaunchEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size,
                  under_torchrun=True).export()
        init_process_group(backend, timeout, store=store, rank=rank, world_size=world_size)
        all_joined(store, world_size)
        result = to_cpu(fn(rank, world_size, *args))
        try:
            message = pickle.dumps(("ok", result))
        except Exception as e:
            raise TypeError(
                f"rank {rank} returned a value that cannot be sent back to the caller "
                f"({type(e).__name__}: {e}); return plain Python values, "
                "tensors, or lists and dicts of them"
            ) from e
        # The result goes to the parent before the group is torn down. Tearing down closes
        # this rank's connections while a peer may be closing its own, and Gloo's transport
        # thread can die on the peer's reset ("terminate called after throwing an instance of
        # 'gloo::IoException'", SIGABRT; pytorch/pytorch#50701, pytorch/gloo#168). A rank of a
        # PowerSGD test died so once in ~2,800 CI tests, its output not kept. An end like that
        # no longer loses a result already computed; a rank that dies in fn still fails.
        report(conn, message)
        message = None
        if dist.is_initialized():  # fn may have torn the group down itself
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - everything a rank raises goes to the caller
        code = 1
        if message is None:  # the result was sent; only the tear-down failed
            os._exit(code)
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
                    message=explain(e),
                    traceback="".join(traceback.format_exception(type(e), e, tb)),
                    exc_blob=blob,
                ),
            )
        )
    try:
        if message is not None:
            report(conn, message)
    finally:
        os._exit(code)  # skip atexit handlers inherited from the parent (Jupyter, torch)


def report(conn, message: bytes) -> None:
    """Send the rank's one message to the parent, once all its output is in the file."""
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send_bytes(message)


def _safe_str(e: BaseException) -> str:
    try:
        return str(e)
    except Exception as inner:
        return f"<str() of the exception failed: {type(inner).__name__}: {inner}>"


def explain(e: BaseException) -> str:
    """The exception's message, with what to do when it is one the launch itself explains."""
    text = _safe_str(e)
    if FORKED_CUDA in text:
        text += (
            "\nThis rank was forked (Gloo's default start) from a process that had already "
            "initialised CUDA; calling torch.cuda.is_available() or device_count() is enough, "
            "and a forked child can then not use CUDA at all. For CUDA tensors on Gloo, launch "
            "with start_method='spawn' and fn defined at module level in a .py file; a lesson "
            "that stays on the CPU needs no change."
        )
    return text


def store_main(timeout: float, port, port_ready) -> None:
    """Body of a store process: serve a ``TCPStore`` on loopback only (127.0.0.1, on a port
    the OS picks), tell the number through ``port``, and keep serving until killed.

    :func:`engine.ft.harness.store_in_a_process` serves its replicas' store this way, as
    a launch once served its rendezvous store (local launches now meet through a private
    ``FileStore``, :func:`rendezvous`). Not the parent: processes forked while the parent's
    store thread runs could inherit a lock it held (seen: one rank of 8 stuck before joining,
    once in 16). ``TCPStore(HOST, 0, is_master=True)`` alone would listen on every interface,
    IPv4 and IPv6, whatever ``HOST`` says; a socket bound to loopback and handed over
    (``master_listen_fd``) keeps it there. It has no credentials: any local user may reach it."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((HOST, 0))
    listener.listen(128)
    store = dist.TCPStore(HOST, listener.getsockname()[1], None, is_master=True,
                          wait_for_workers=False, timeout=timedelta(seconds=timeout),
                          master_listen_fd=listener.fileno())
    port.value = store.port
    port_ready.set()
    while True:
        signal.pause()  # until killed


def rendezvous(store_path: str, timeout: float) -> dist.Store:
    """The launch's rendezvous store: a ``FileStore`` at ``store_path``, in the directory the
    parent made for this launch (``tempfile.mkdtemp``: mode 0700, this user's alone, removed
    when the launch ends). No other user can read or write a key, and nothing listens on a
    port. It outlives every rank (a file, not a process), so a rank outside a group may finish
    while the group's members still meet through it (tests/test_launch_store.py)."""
    store = dist.FileStore(store_path, -1)  # -1: no rank deletes the file; the parent does
    store.set_timeout(timedelta(seconds=timeout))
    return store


def all_joined(store: dist.Store, world_size: int) -> None:
    """Return once every rank has joined the process group. A rank whose ``fn`` returns at
    once would otherwise exit, closing its connections, while a peer was still connecting to
    it: Gloo's ``connectFullMesh`` failed with "Connection closed by peer" (2 launches in 100
    on a loaded 2-core machine, before and after the store became a file). On Gloo a barrier
    (well under a millisecond); on NCCL, whose first collective would build communicators, a
    count in the store (its file is polled every 10 ms)."""
    if dist.get_backend() == "gloo":
        dist.barrier()
        return
    if store.add("engine/joined", 1) == world_size:
        store.set("engine/all_joined", b"1")
    store.wait(["engine/all_joined"])


LOOPBACK = "lo"  # Linux's loopback interface


def loopback_only() -> None:
    """Keep this rank's Gloo and NCCL listeners on loopback: every peer of a local launch is on
    this machine. Unset, Gloo binds to the address this host's name resolves to, and NCCL to
    the first interface it likes, reachable from the network."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return
    if LOOPBACK in names:
        os.environ["GLOO_SOCKET_IFNAME"] = LOOPBACK
        os.environ["NCCL_SOCKET_IFNAME"] = LOOPBACK


def capture_output(path: str) -> None:
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


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """Ask Linux to send this process ``signum`` (SIGKILL) if its parent dies first (no
    orphans, even on kill -9): a rank :func:`engine.launch` started (its keeper gets SIGTERM,
    to end what is below it first), or a torchrun worker (:func:`engine.launch.elastic.
    die_with_agent`)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signum)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def to_cpu(value):
    """Move tensors in (nested lists/tuples/dicts of) ``value`` to the CPU, to send them back."""
    if isinstance(value, torch.Tensor):
        return value.cpu() if value.device.type != "cpu" else value
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(to_cpu(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: to_cpu(v) for k, v in value.items()}
    return value
