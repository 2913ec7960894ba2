"""What a rank started never outlives it: a subreaper, and the processes below it in /proc.

A process a rank starts may detach itself: a double fork, ``os.setsid()`` in a grandchild, a
daemon. It then leaves the rank's process group, so killing the group misses it, and its
parent's exit would hand it to init, where nothing of the launch could find it again. Each
rank's first process is therefore a *keeper* (:func:`engine.launch.rank.rank_main`): a child
subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``, Linux 3.4), so every process below it that loses
its parent is re-parented to the keeper instead of to init, and stays below it in /proc however
it detached. When the rank ends, the keeper kills everything below it
(:func:`end_descendants`), and nothing else: it reads its own subtree, never the launching
process's other children or its process group.

Linux only, and no root needed. The other ways to the same end were set aside: a PID namespace
needs ``CAP_SYS_ADMIN`` or an unprivileged user namespace (often disabled, and it changes every
pid and uid a rank sees); a cgroup needs a delegated cgroup tree; making the launching process
itself the subreaper (a notebook's kernel, a grader) would adopt the orphans of everything else
it runs while a launch lasts, and they could not be told apart from the ranks' own.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37


def _prctl(*args) -> int:
    if not sys.platform.startswith("linux"):
        return -1
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(*args)
    except (OSError, AttributeError):
        return -1


def become_subreaper(on: bool = True) -> bool:
    """Make this process the child subreaper of everything below it (``on=False``: stop being
    one). False where the system cannot (not Linux, or a kernel older than 3.4): a process
    that detaches then escapes."""
    return _prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0


def is_subreaper() -> bool:
    """This process is a child subreaper now."""
    flag = ctypes.c_int(0)
    return _prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0 and bool(flag.value)


def children_by_parent() -> dict[int, list[int]]:
    """Every live (not zombie) process in /proc, as ``{parent pid: [child pid, ...]}``."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return children
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if fields[0] in (b"Z", b"X"):  # a zombie waits to be reaped; it can start nothing
            continue
        children.setdefault(int(fields[1]), []).append(int(name))
    return children


def descendants(pid: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...), from /proc (or from
    ``children``, a :func:`children_by_parent` already read)."""
    children = children_by_parent() if children is None else children
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_if_below(pid: int, ancestors: set[int]) -> None:
    """SIGKILL ``pid`` if it is still the process found below ``ancestors``: a pid freed and
    reused since the scan belongs to another process, whose parent is not among them."""
    try:
        handle = os.pidfd_open(pid)  # pins the process: the checks below and the kill agree
    except ProcessLookupError:
        return
    except (OSError, AttributeError):  # no pidfd (Linux < 5.3): a plain kill after the check
        handle = None
    try:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except OSError:
            return
        if ppid not in ancestors:
            return
        try:
            if handle is not None:
                signal.pidfd_send_signal(handle, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    finally:
        if handle is not None:
            os.close(handle)


def reap_children() -> None:
    """Collect every child of this process that has exited, without waiting for the others."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def has_children() -> bool:
    """This process has a child, alive or not yet reaped (no /proc scan). For a subreaper
    whose children have all ended, False means nothing at all is below it: a process below
    it that lost its parent was handed to it, and so is its child."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def end_descendants(within_s: float = 5.0) -> list[int]:
    """SIGKILL every process below this one and reap those re-parented here, until none is
    left (or ``within_s`` has passed: a process stuck in the kernel dies when it returns).

    Meant for a subreaper (:func:`become_subreaper`): then every process that was ever below
    it is still below it, and a process killed here hands its own children to this one, so
    the next scan finds them. Returns the pids that were killed."""
    me, killed = os.getpid(), []
    give_up = time.monotonic() + within_s
    while True:
        below = descendants(me)
        if not below:
            break
        ancestors = {me, *below}
        for pid in below:
            _kill_if_below(pid, ancestors)
        killed.extend(p for p in below if p not in killed)
        reap_children()
        if time.monotonic() > give_up:
            break
        time.sleep(0.002)  # SIGKILL is delivered asynchronously
    reap_children()
    return killed
