"""The rank body: what each process :func:`engine.launch` starts does, from birth to exit.

It isolates itself (its own process group, killed with its parent, Ctrl-C left to the parent),
sends its output to a file the parent prints afterwards, meets its siblings through the
rendezvous store a process of its own serves (:func:`store_main`), joins the process group,
runs ``fn`` and sends back one message: ``("ok", result)`` or ``("error", what it raised)``. It
never returns: it exits with ``os._exit``, skipping the atexit handlers it inherited from the
parent (Jupyter, torch).
"""

from __future__ import annotations

import ctypes
import faulthandler
import io
import os
import pickle
import signal
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.launch.backend import init_process_group
from engine.launch.env import LaunchEnv

HOST = "127.0.0.1"  # where a local launch's rendezvous store listens

# What torch raises when a forked child uses CUDA after its parent initialised the driver.
FORKED_CUDA = "Cannot re-initialize CUDA in forked subprocess"


def rank_main(fn, rank, world_size, args, backend, timeout, port, port_ready, out_path, conn):
    """Body of every rank process: isolate, capture output, join the group, run ``fn``, report."""
    os.setpgid(0, 0)  # our own process group: the parent can kill us and anything we started
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    capture_output(out_path)
    torch.set_num_threads(1)
    code = 0
    try:
        store = rendezvous(rank, world_size, timeout, port, port_ready)
        # as torchrun sets them, for fn's own code and any process it starts
        LaunchEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size,
                  under_torchrun=True, master_addr=HOST, master_port=port.value).export()
        init_process_group(backend, timeout, store=store, rank=rank, world_size=world_size)
        result = to_cpu(fn(rank, world_size, *args))
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
                    message=explain(e),
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
    """Body of the launch's store process: serve the rendezvous store on a port the OS picks,
    tell the ranks its number, and keep serving until the launch kills it (as torchrun's agent
    serves its own, apart from the workers).

    Not rank 0: ``dist.new_group`` returns at once on a rank outside the group while its
    members still meet through the store, so a rank 0 outside a group could finish and exit,
    taking the store with it ("Failed to recv", "Broken pipe" on a member;
    tests/test_launch_store.py). Keeping rank 0 alive until every rank was done instead made
    an unmatched send surface only at the timeout, and counting the ranks out after
    ``destroy_process_group`` aborted PowerSGD's DDP test (SIGABRT, "Resource deadlock
    avoided"). Not the parent either: ranks forked while the parent's store thread runs
    could inherit a lock it held (seen: one rank of 8 stuck before joining, once in 16)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    store = dist.TCPStore(HOST, 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    port.value = store.port
    port_ready.set()
    while True:
        signal.pause()  # until killed


def rendezvous(rank, world_size, timeout, port, port_ready) -> dist.Store:
    """Connect to the launch's store (:func:`store_main`), once its port is known."""
    if not port_ready.wait(timeout):
        raise TimeoutError(f"rank {rank}: the launch's store did not start within {timeout:g} s")
    return dist.TCPStore(HOST, port.value, world_size, is_master=False,
                         timeout=timedelta(seconds=timeout))


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


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process if its parent dies first (no orphans, even on kill -9):
    a rank :func:`engine.launch` started, or a torchrun worker (:func:`engine.elastic.
    die_with_agent`)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
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
