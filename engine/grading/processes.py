"""The grader owns every process a submission starts: it adopts orphans while it grades (Linux's
child subreaper), finds what is left under a worker by walking ``/proc``, and kills it by PID,
never by process group, so a process that joined the grader's own group cannot make the grader
kill itself."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37


def _prctl(option: int, value: int = 0) -> int:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return -1
    if option == PR_GET_CHILD_SUBREAPER:
        out = ctypes.c_int(0)
        return out.value if libc.prctl(option, ctypes.byref(out)) == 0 else -1
    return libc.prctl(option, value)


class Subreaper:
    """While open, this process adopts the orphans of its descendants (Linux's child subreaper),
    so a daemon a submission detached is still found among this process's children."""

    def __enter__(self):
        self.was = _prctl(PR_GET_CHILD_SUBREAPER)
        if self.was == 0:
            _prctl(PR_SET_CHILD_SUBREAPER, 1)
        return self

    def __exit__(self, *exc):
        if self.was == 0:
            _prctl(PR_SET_CHILD_SUBREAPER, 0)


def _parents() -> dict[int, int]:
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            found[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def descendants(pid: int, parents: dict[int, int] | None = None) -> list[int]:
    """Every live process started, directly or not, by ``pid`` (read from /proc)."""
    parents = _parents() if parents is None else parents
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_processes(root: int, adopted_since: set[int] | None = None) -> None:
    """SIGKILL ``root`` and every process under it, by PID, until none is left; with
    ``adopted_since`` (this process's children before ``root`` started), also every newer
    child of this process and what is under it (orphans it adopted as a subreaper). Never a
    process group, so never this process's own."""
    me = os.getpid()
    for _ in range(50):
        parents = _parents()
        targets = {root} | set(descendants(root, parents)) if root in parents else set()
        if adopted_since is not None:
            for child, parent in parents.items():
                if parent == me and child not in adopted_since and child != root:
                    targets |= {child, *descendants(child, parents)}
        targets.discard(me)
        if not targets:
            return
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in targets:  # reap our own (the worker, adopted orphans): no zombie left
            if parents.get(pid) == me:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
        time.sleep(0.02)


def my_children() -> set[int]:
    me = os.getpid()
    return {child for child, parent in _parents().items() if parent == me}
