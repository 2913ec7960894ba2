"""Helpers for tests that run code on several ranks."""

from __future__ import annotations

import os
from multiprocessing import resource_tracker
from pathlib import Path

from engine import launch

RANK_TIMEOUT_S = 30  # per launch; each test also has pytest-timeout's limit around it


def run_ranks(fn, world_size: int, *args, timeout: float = RANK_TIMEOUT_S):
    """``fn(rank, world_size, *args)`` on ``world_size`` Gloo ranks; the results in rank order."""
    return launch(fn, world_size, *args, backend="gloo", timeout=timeout, quiet=True)


def descendants(pid: int | None = None) -> list[int]:
    """Pids of every process below ``pid`` (default: this one), zombies included, from /proc.

    Python's own multiprocessing resource tracker (started once by any spawn) is not counted:
    it is a helper of this process that lives as long as it does, not a leftover rank.
    """
    pid = os.getpid() if pid is None else pid
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, stack = [], list(children.get(pid, []))
    while stack:
        p = stack.pop()
        found.append(p)
        stack.extend(children.get(p, []))
    return [p for p in found if p != tracker]


def is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"
