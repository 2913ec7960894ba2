"""Three replicas, one killed and restarted: the fault-tolerance experiment, and its reference.

:func:`run_with_failure` hosts a ``TCPStore`` in this process, forks ``replicas`` replica
processes (one rank each), and lets replica ``kill[0]`` SIGKILL itself at step ``kill[1]``,
after it joined the quorum and computed its gradient and just before the all-reduce: the
worst moment for the others, whose all-reduce fails mid-step. The survivors are not restarted:
they abort that round and redo the step without it. Once they have committed
``restart_after`` more steps, the killed replica is started again (incarnation 1); it joins a
later round and receives the state from a live peer. Every process is killed in a ``finally``
and every wait has a timeout.

:func:`reference_run` recomputes the run in one process from the survivors' log: at each step
the gradient averaged over exactly that step's quorum.
"""

from __future__ import annotations

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


@dataclass
class FailureRun:
    """What :func:`run_with_failure` measured (seconds are wall time)."""

    finals: dict[int, dict]  # replica -> {"model", "optimizer", "step"} at the end
    logs: dict[int, list]  # replica -> [(step, members, seconds, attempts)] it committed
    killed: tuple[int, int]  # (replica, step)
    rejoined_step: int  # the step whose quorum first held the restarted replica
    recovery_bit_identical: bool  # its state after loading has the digest of the source's
    rejoin_seconds: float  # restart -> its first committed step
    step_seconds: float  # a healthy step of the survivors (median)
    failed_step_seconds: float  # the survivors' step k, failure and retry included
    wall_seconds: float
    exit_codes: dict[int, list] = field(default_factory=dict)

    @property
    def lost_seconds(self) -> float:
        """Wall time the failure cost the survivors: step k less a healthy step."""
        return self.failed_step_seconds - self.step_seconds


def _replica_main(port, replica, replicas, incarnation, steps, kill, model_fn, optimizer_fn,
                  loss_fn, deadline_s, timeout_s):
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    torch.set_num_threads(1)
    started = time.perf_counter()
    model = model_fn()
    optimizer = optimizer_fn(model)
    ft = FaultTolerantReplica(store, replica, replicas, model, optimizer, incarnation,
                              deadline_s, timeout_s)

    def die_here(step, quorum):
        if incarnation == 0 and (replica, step) == tuple(kill):
            os.kill(os.getpid(), signal.SIGKILL)

    first = None
    while ft.completed < steps:
        ft.train_step(lambda step: loss_fn(model, step, replica), die_here)
        first = time.perf_counter() if first is None else first
        store.set(f"progress/{replica}", str(ft.completed))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "step": ft.completed}, buffer)
    store.set(f"final/{replica}", buffer.getvalue())
    store.set(f"log/{replica}", json.dumps({
        "log": [(s, list(m), sec, a) for s, m, sec, a in ft.log],
        "recovered_step": ft.recovered_step, "recovered_digest": ft.recovered_digest,
        "sent_digests": {str(k): v for k, v in ft.sent_digests.items()},
        "rejoin_seconds": (first - started) if incarnation else None}))


def run_with_failure(model_fn, optimizer_fn, loss_fn, replicas: int = 3, steps: int = 10,
                     kill: tuple[int, int] = (2, 3), restart_after: int = 2,
                     deadline_s: float = 1.0, timeout_s: float = 5.0,
                     run_timeout_s: float = 60.0) -> FailureRun:
    """Run ``replicas`` fault-tolerant replicas for ``steps`` steps, killing replica
    ``kill[0]`` at step ``kill[1]`` and restarting it ``restart_after`` steps later.
    ``loss_fn(model, step, replica)`` is a replica's loss on its batch of ``step``."""
    victim, kill_step = kill
    if not 0 <= victim < replicas or not 0 <= kill_step < steps - restart_after - 2:
        raise ValueError(f"kill = {kill} must name a replica in 0..{replicas - 1} and a step "
                         f"before {steps - restart_after - 2} (steps = {steps})")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    context = multiprocessing.get_context("fork")
    procs: dict[int, list] = {}

    def start(replica, incarnation):
        proc = context.Process(target=_replica_main, daemon=True, args=(
            store.port, replica, replicas, incarnation, steps, kill, model_fn, optimizer_fn,
            loss_fn, deadline_s, timeout_s))
        proc.start()
        procs.setdefault(replica, []).append(proc)

    survivor = (victim + 1) % replicas
    began = time.perf_counter()
    give_up = time.monotonic() + run_timeout_s
    try:
        for replica in range(replicas):
            start(replica, 0)
        restarted = False
        while any(p.is_alive() for ps in procs.values() for p in ps):
            if time.monotonic() > give_up:
                raise TimeoutError(f"the fault-tolerance run did not end in {run_timeout_s} s")
            if not restarted and procs[victim][0].exitcode is not None and \
                    store.check([f"progress/{survivor}"]) and \
                    int(store.get(f"progress/{survivor}")) >= kill_step + 1 + restart_after:
                store.set(f"want/{victim}", "1")  # announced: the next quorum waits for it
                start(victim, 1)
                restarted = True
            time.sleep(0.005)
        wall = time.perf_counter() - began
        codes = {r: [p.exitcode for p in ps] for r, ps in procs.items()}
        missing = [r for r in range(replicas) if not store.check([f"final/{r}"])]
        if missing or not restarted:
            raise RuntimeError(f"replicas {missing} did not finish (exit codes {codes}; "
                               f"restarted: {restarted})")
        finals = {r: torch.load(io.BytesIO(store.get(f"final/{r}")), weights_only=True)
                  for r in range(replicas)}
        info = {r: json.loads(store.get(f"log/{r}")) for r in range(replicas)}
    finally:
        for ps in procs.values():
            for p in ps:
                if p.is_alive():
                    p.kill()
                p.join(timeout=5)
    healthy = sorted(sec for s, _, sec, a in info[survivor]["log"] if a == 0 and s > 0)
    failed = next(sec for s, _, sec, _ in info[survivor]["log"] if s == kill_step)
    return FailureRun(
        finals=finals, logs={r: [(s, tuple(m), sec, a) for s, m, sec, a in info[r]["log"]]
                             for r in info},
        killed=kill, rejoined_step=info[victim]["recovered_step"],
        recovery_bit_identical=_same_state(info, victim),
        rejoin_seconds=info[victim]["rejoin_seconds"],
        step_seconds=healthy[len(healthy) // 2], failed_step_seconds=failed,
        wall_seconds=wall, exit_codes=codes)


def _same_state(info: dict, victim: int) -> bool:
    """The restarted replica's state digest after loading = the one its source sent."""
    step, got = info[victim]["recovered_step"], info[victim]["recovered_digest"]
    sent = [i["sent_digests"].get(str(step)) for i in info.values()]
    return got is not None and got in sent


def reference_run(model_fn, optimizer_fn, loss_fn, log) -> dict:
    """The run recomputed in one process from a survivor's ``log``: at each step, the
    gradients of that step's quorum members, summed in member order and divided by their
    count, applied by one optimizer. Returns the model's ``state_dict``."""
    model = model_fn()
    optimizer = optimizer_fn(model)
    params = [p for p in model.parameters() if p.requires_grad]
    for step, members, *_ in log:
        grads = []
        for member in members:
            optimizer.zero_grad()
            loss_fn(model, step, member).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
        average = sum(grads[1:], grads[0].clone()) / len(members)
        offset = 0
        for p in params:
            p.grad = average[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        optimizer.step()
    return model.state_dict()
