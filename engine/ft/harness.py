"""Three replica groups, one killed and restarted: the fault-tolerance experiment, and its
reference.

:func:`run_with_failure` serves a ``TCPStore`` from a process of its own
(:func:`store_in_a_process`: not this process, whose store thread a forked rank could inherit
mid-lock), forks ``replicas`` replica groups of ``group_size`` ranks each, and lets every rank
of group ``kill[0]`` SIGKILL itself at step ``kill[1]``, after it joined the quorum and
computed its gradient and just before the all-reduce: the worst moment for the others, whose
all-reduce fails mid-step. The survivors are not restarted:
they abort that round and redo the step without it. Once they have committed
``restart_after`` more steps, the killed replica is started again (incarnation 1); it joins a
later round and receives the state from a live peer. Every process is killed in a ``finally``
(the store's last, once the replicas are gone) and every wait has a timeout.

:func:`reference_run` recomputes the run in one process from the survivors' log: at each step
the gradient averaged over exactly that step's quorum.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.ft.replica import FaultTolerantReplica
from engine.launch.rank import HOST, store_main
from engine.validation import divides, positive_int


@dataclass
class FailureRun:
    """What :func:`run_with_failure` measured (seconds are wall time)."""

    finals: dict[str, dict]  # "replica.local" -> {"model", "optimizer", "step"} at the end
    logs: dict[str, list]  # "replica.local" -> [(step, members, seconds, attempts)]
    killed: tuple[int, int]  # (replica, step)
    rejoined_step: int  # the step whose quorum first held the restarted replica
    recovery_bit_identical: bool  # its state after loading has the digest of the source's
    rejoin_seconds: float  # restart -> its first committed step
    step_seconds: float  # a healthy step of the survivors (median)
    failed_step_seconds: float  # the survivors' step k, failure and retry included
    wall_seconds: float
    exit_codes: dict[tuple[int, int], list] = field(default_factory=dict)
    cross_bytes: dict[str, int] = field(default_factory=dict)  # all-reduced across groups
    recovery_bytes: dict[str, int] = field(default_factory=dict)  # sent to a rejoining group

    @property
    def lost_seconds(self) -> float:
        """Wall time the failure cost the survivors: step k less a healthy step."""
        return self.failed_step_seconds - self.step_seconds


def check_replica_groups(world_size: int, group_size: int) -> int:
    """The number of replica groups; a ValueError names both numbers when ``group_size``
    does not divide ``world_size``."""
    positive_int("world_size", world_size)
    positive_int("group_size (ranks per replica group)", group_size)
    divides("group_size (ranks per replica group)", group_size, "the world size", world_size)
    return world_size // group_size


def warm_up(model_fn, optimizer_fn, loss_fn) -> None:
    """One step in this process before forking the ranks: a process's first optimizer and
    its first step import lazily (``torch._dynamo``: seconds on a loaded 2-core machine),
    which every forked rank would otherwise pay at once, in its first step's time."""
    model = model_fn()
    loss_fn(model, 0, 0).backward()
    optimizer_fn(model).step()


@contextlib.contextmanager
def store_in_a_process(timeout_s: float, start_timeout_s: float = 30.0, context=None):
    """A ``TCPStore`` served by a process of its own (:func:`engine.launch.rank.store_main`,
    listening on loopback only), and this process's client of it: forking from here is then
    safe, no store thread runs in this process. The server is killed and reaped
    on exit, so call it around (outside) the processes that use the store."""
    context = context or multiprocessing.get_context("fork")
    port, port_ready = context.Value("i", 0), context.Event()
    server = context.Process(target=store_main, name="ft-store", daemon=True,
                             args=(timeout_s, port, port_ready))
    server.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not port_ready.wait(0.05):  # a store process that dies is reported at once
            if not server.is_alive():
                raise RuntimeError(f"the store process exited (code {server.exitcode}) "
                                   "before serving")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the store process did not serve within "
                                   f"{start_timeout_s:g} s")
        yield dist.TCPStore(HOST, port.value, is_master=False,
                            timeout=datetime.timedelta(seconds=timeout_s))
    finally:
        server.kill()
        server.join(timeout=5)


def _replica_main(port, replica, local, group_size, replicas, incarnation, steps, kill,
                  model_fn, optimizer_fn, loss_fn, deadline_s, timeout_s):
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    torch.set_num_threads(1)
    started = time.perf_counter()
    model = model_fn()
    optimizer = optimizer_fn(model)
    ft = FaultTolerantReplica(store, replica, replicas, model, optimizer, incarnation,
                              deadline_s, timeout_s, local_rank=local, group_size=group_size)
    rank = replica * group_size + local

    def die_here(step, quorum):  # every rank of the killed group, at the same point
        if incarnation == 0 and (replica, step) == tuple(kill):
            os.kill(os.getpid(), signal.SIGKILL)

    first = None
    while ft.completed < steps:
        ft.train_step(lambda step: loss_fn(model, step, rank), die_here)
        first = time.perf_counter() if first is None else first
        store.set(f"progress/{replica}.{local}", str(ft.completed))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "step": ft.completed}, buffer)
    store.set(f"final/{replica}.{local}", buffer.getvalue())
    store.set(f"log/{replica}.{local}", json.dumps({
        "log": [(s, list(m), sec, a) for s, m, sec, a in ft.log],
        "recovered_step": ft.recovered_step, "recovered_digest": ft.recovered_digest,
        "sent_digests": {str(k): v for k, v in ft.sent_digests.items()},
        "cross_bytes": ft.group.allreduce_bytes, "recovery_bytes": ft.group.recovery_bytes,
        "rejoin_seconds": (first - started) if incarnation else None}))


def run_with_failure(model_fn, optimizer_fn, loss_fn, replicas: int = 3, steps: int = 10,
                     kill: tuple[int, int] = (2, 3), restart_after: int = 2,
                     deadline_s: float = 1.0, timeout_s: float = 5.0,
                     run_timeout_s: float = 60.0, group_size: int = 1) -> FailureRun:
    """Run ``replicas`` fault-tolerant replica groups of ``group_size`` ranks for ``steps``
    steps, killing every rank of group ``kill[0]`` at step ``kill[1]`` and restarting the
    group ``restart_after`` steps later. ``loss_fn(model, step, rank)`` is a rank's loss on
    its batch of ``step`` (``rank = replica * group_size + local rank``)."""
    positive_int("replicas (replica groups)", replicas)
    positive_int("group_size (ranks per replica group)", group_size)
    positive_int("steps", steps)
    check_replica_groups(replicas * group_size, group_size)
    victim, kill_step = kill
    if not 0 <= victim < replicas or not 0 <= kill_step < steps - restart_after - 2:
        raise ValueError(f"kill = {kill} must name a replica group in 0..{replicas - 1} and a "
                         f"step before {steps - restart_after - 2} (steps = {steps})")
    warm_up(model_fn, optimizer_fn, loss_fn)
    context = multiprocessing.get_context("fork")
    with store_in_a_process(timeout_s, run_timeout_s, context) as store:
        return _run_replicas(store, context, model_fn, optimizer_fn, loss_fn, replicas, steps,
                             kill, restart_after, deadline_s, timeout_s, run_timeout_s,
                             group_size)


def _run_replicas(store, context, model_fn, optimizer_fn, loss_fn, replicas, steps, kill,
                  restart_after, deadline_s, timeout_s, run_timeout_s, group_size
                  ) -> FailureRun:
    """:func:`run_with_failure` once its arguments are checked and its store serves."""
    victim, kill_step = kill
    procs: dict[tuple[int, int], list] = {}

    def start(replica, incarnation):
        for local in range(group_size):
            proc = context.Process(target=_replica_main, daemon=True, args=(
                store.port, replica, local, group_size, replicas, incarnation, steps, kill,
                model_fn, optimizer_fn, loss_fn, deadline_s, timeout_s))
            proc.start()
            procs.setdefault((replica, local), []).append(proc)

    survivor = (victim + 1) % replicas
    began = time.perf_counter()
    give_up = time.monotonic() + run_timeout_s
    names = [f"{r}.{l}" for r in range(replicas) for l in range(group_size)]
    try:
        for replica in range(replicas):
            start(replica, 0)
        restarted = False
        while any(p.is_alive() for ps in procs.values() for p in ps):
            if time.monotonic() > give_up:
                raise TimeoutError(f"the fault-tolerance run did not end in {run_timeout_s} s")
            if not restarted and all(procs[(victim, l)][0].exitcode is not None
                                     for l in range(group_size)) and \
                    store.check([f"progress/{survivor}.0"]) and \
                    int(store.get(f"progress/{survivor}.0")) >= kill_step + 1 + restart_after:
                store.set(f"want/{victim}", "1")  # announced: the next quorum waits for it
                start(victim, 1)
                restarted = True
            time.sleep(0.005)
        wall = time.perf_counter() - began
        codes = {key: [p.exitcode for p in ps] for key, ps in procs.items()}
        missing = [n for n in names if not store.check([f"final/{n}"])]
        if missing or not restarted:
            raise RuntimeError(f"ranks {missing} did not finish (exit codes {codes}; "
                               f"restarted: {restarted})")
        finals = {n: torch.load(io.BytesIO(store.get(f"final/{n}")), weights_only=True)
                  for n in names}
        info = {n: json.loads(store.get(f"log/{n}")) for n in names}
    finally:
        for ps in procs.values():
            for p in ps:
                if p.is_alive():
                    p.kill()
                p.join(timeout=5)
    mine = info[f"{survivor}.0"]["log"]
    healthy = sorted(sec for s, _, sec, a in mine if a == 0 and s > 0)
    failed = next(sec for s, _, sec, _ in mine if s == kill_step)
    return FailureRun(
        finals=finals, logs={n: [(s, tuple(m), sec, a) for s, m, sec, a in info[n]["log"]]
                             for n in info},
        killed=kill, rejoined_step=info[f"{victim}.0"]["recovered_step"],
        recovery_bit_identical=all(_same_state(info, f"{victim}.{l}", l)
                                   for l in range(group_size)),
        rejoin_seconds=info[f"{victim}.0"]["rejoin_seconds"],
        step_seconds=healthy[len(healthy) // 2], failed_step_seconds=failed,
        wall_seconds=wall, exit_codes=codes,
        cross_bytes={n: i["cross_bytes"] for n, i in info.items()},
        recovery_bytes={n: i["recovery_bytes"] for n, i in info.items()})


def _same_state(info: dict, name: str, local: int) -> bool:
    """A restarted rank's state digest after loading = the one its source rank sent."""
    step, got = info[name]["recovered_step"], info[name]["recovered_digest"]
    sent = [i["sent_digests"].get(str(step)) for n, i in info.items()
            if n.endswith(f".{local}")]
    return got is not None and got in sent


def reference_run(model_fn, optimizer_fn, loss_fn, log, group_size: int = 1) -> dict:
    """The run recomputed in one process from a survivor's ``log``: at each step, each member
    group's gradient (the mean of its ranks'), averaged over that step's members, applied by
    one optimizer. Returns the model's ``state_dict``."""
    model = model_fn()
    optimizer = optimizer_fn(model)
    params = [p for p in model.parameters() if p.requires_grad]

    def gradient(step, rank):
        optimizer.zero_grad()
        loss_fn(model, step, rank).backward()
        return torch.cat([p.grad.reshape(-1) for p in params])

    for step, members, *_ in log:
        groups = []
        for member in members:
            ranks = [gradient(step, member * group_size + l) for l in range(group_size)]
            groups.append(sum(ranks[1:], ranks[0].clone()) / group_size)
        average = sum(groups[1:], groups[0].clone()) / len(members)
        offset = 0
        for p in params:
            p.grad = average[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        optimizer.step()
    return model.state_dict()
