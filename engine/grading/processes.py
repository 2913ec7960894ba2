"""The grader owns every process a submission starts: it adopts orphans while it grades (Linux's
child subreaper, :mod:`engine.launch.reaper`), finds what is left under a worker in ``/proc``,
and kills it by PID, never by process group, so a process that joined the grader's own group
cannot make the grader kill itself."""

from __future__ import annotations

import os
import signal
import time

from engine.launch.reaper import become_subreaper, children_by_parent, descendants, is_subreaper

__all__ = ["Subreaper", "descendants", "kill_processes", "my_children"]


class Subreaper:
    """While open, this process adopts the orphans of its descendants, so a daemon a
    submission detached (``setsid`` and a double fork) is still found among its children."""

    def __enter__(self):
        self.was = is_subreaper()
        if not self.was:
            become_subreaper(True)
        return self

    def __exit__(self, *exc):
        if not self.was:
            become_subreaper(False)


def kill_processes(root: int, adopted_since: set[int] | None = None) -> None:
    """SIGKILL ``root`` and every process under it, by PID, until none is left; with
    ``adopted_since`` (this process's children before ``root`` started), also every newer
    child of this process and what is under it (orphans it adopted as a subreaper). Never a
    process group, so never this process's own."""
    me, killed = os.getpid(), {root}
    for _ in range(50):
        children = children_by_parent()
        alive = {c for kids in children.values() for c in kids}
        targets = {root, *descendants(root, children)} if root in alive else set()
        if adopted_since is not None:
            for child in children.get(me, []):
                if child not in adopted_since and child != root:
                    targets |= {child, *descendants(child, children)}
        targets.discard(me)
        if not targets:
            break
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        killed |= targets
        time.sleep(0.02)
    _reap(killed)  # those that were (or became) this process's children: no zombie left


def _reap(pids: set[int]) -> None:
    """Collect those of ``pids`` that are this process's children and have ended."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def my_children() -> set[int]:
    """This process's live children."""
    return set(children_by_parent().get(os.getpid(), []))
