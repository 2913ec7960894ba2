"""engine.diloco beside torchft's ``torchft.local_sgd.DiLoCo`` (the optional extra
``pip install -e ".[ft]"``; skipped, with the reason, where torchft is not installed).

The same configuration both ways: two replicas of the same MLP, AdamW inside, an outer SGD
with Nesterov momentum (0.7, 0.9), H = 2, three syncs, each replica its own batches; one
fragment, and two (streaming DiLoCo, one Linear layer each, one outer optimizer per fragment as
torchft's own trainer has it: a single outer SGD over the whole model would also step the
fragments not being synced, on the inner gradients their ``.grad`` still holds). torchft runs as it is meant to: a
``LighthouseServer`` (its Rust quorum service, shipped in the wheel), one ``Manager`` per
replica on its own ``TCPStore``, its ``ProcessGroupGloo``; the two replicas are threads of this
process, as in torchft's own integration tests. The engine runs its two replicas as two Gloo
ranks.

Measured (torch 2.13 CPU, torchft 0.2.0): with ``Manager(init_sync=False)`` the losses and the
parameters are equal **bit for bit**. With torchft's default ``init_sync=True`` they differ, by
design: the first quorum heals every replica from replica 0 at step 0, and DiLoCo opens that
quorum only at its first sync, after H inner steps, so replica 1's first H steps are replaced
by replica 0's (its parameters and AdamW state). The test asserts that exact difference:
torchft with ``init_sync=True`` equals the engine run in which replica 1 trains on replica 0's
batches for the first H steps.

A replica that joins late: under torchft's ``Manager`` (data parallelism, a quorum every step)
it heals from a live peer to the others' bits, as :mod:`engine.ft`'s restarted group does; the
time from its start to its first committed step is printed both ways (measured here: torchft
0.12 s for a thread in a warm process, engine.ft 0.33 s for a forked process that also waits
for the next round's quorum).
"""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from torch import nn

from engine.diloco import DiLoCo
from engine.models import MLP, regression_data
from tests.helpers import run_ranks

torchft = pytest.importorskip(
    "torchft", reason="torchft is an optional extra: pip install -e '.[ft]' (Linux wheels with "
                      "its Rust lighthouse; it keeps the installed torch)")

H, SYNCS, SIZES, SEED = 2, 3, (8, 16, 8), 3


def _loss(model, step: int, replica: int, same_first_window: bool = False):
    data_of = 0 if same_first_window and step < H else replica
    x, y = regression_data(8, 8, 8, seed=100 * step + data_of)
    return nn.functional.mse_loss(model(x), y)


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _torchft_replica(replica: int, lighthouse: str, model, fragments: int, init_sync: bool):
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    timeout = datetime.timedelta(seconds=20)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=2, use_async_quorum=False,
        load_state_dict=lambda s: (model.load_state_dict(s["model"]),
                                   inner.load_state_dict(s["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        replica_id=str(replica), store_addr="localhost", store_port=store.port, rank=0,
        world_size=1, lighthouse_addr=lighthouse, port=0, hostname="localhost",
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout, init_sync=init_sync)
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    parts = [model] if fragments == 1 else layers
    # one outer optimizer per fragment, as torchft's own trainer has it: a single one over
    # the whole model would also step the other fragments, on their inner gradients
    outer = [torch.optim.SGD(part.parameters(), lr=0.7, momentum=0.9, nesterov=True)
             for part in parts]
    losses = []
    try:
        with TorchftDiLoCo(manager, parts, inner, outer, sync_every=H,
                           backup_device=torch.device("cpu"), pin_memory=False):
            for step in range(H * SYNCS):
                inner.zero_grad()
                loss = _loss(model, step, replica)
                loss.backward()
                inner.step()
                losses.append(loss.item())
    finally:
        manager.shutdown(wait=False)
    return _state(model), losses


def _torchft_run(fragments: int, init_sync: bool):
    from torchft._torchft import LighthouseServer

    models = [MLP(SIZES, seed=SEED) for _ in range(2)]  # built here: the global RNG, once
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(_torchft_replica, r, lighthouse.address(), models[r],
                                   fragments, init_sync) for r in range(2)]
            return [f.result(timeout=120) for f in futures]
    finally:
        lighthouse.shutdown()


def _engine_rank(rank, world_size, fragments: int, same_first_window: bool):
    model = MLP(SIZES, seed=SEED)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = DiLoCo(model, inner, sync_every=H, outer_lr=0.7, outer_momentum=0.9,
                    nesterov=True, fragments=fragments)
    losses = []
    for step in range(H * SYNCS):
        inner.zero_grad()
        loss = _loss(model, step, rank, same_first_window)
        loss.backward()
        inner.step()
        diloco.step()
        losses.append(loss.item())
    return _state(model), losses


def _assert_same(ours, theirs) -> None:
    for (state, losses), (their_state, their_losses) in zip(ours, theirs, strict=True):
        assert losses == their_losses
        for name, t in state.items():
            assert torch.equal(t, their_state[name]), name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fragments", [1, 2])
def test_torchft_diloco_equals_the_engine_bit_for_bit(fragments):
    _assert_same(run_ranks(_engine_rank, 2, fragments, False), _torchft_run(fragments, False))


@pytest.mark.timeout(120)
def test_torchft_init_sync_replaces_the_first_window_with_replica_0s():
    theirs = _torchft_run(1, True)
    healed = run_ranks(_engine_rank, 2, 1, True)  # replica 1 on replica 0's first batches
    _assert_same(healed[:1], theirs[:1])  # replica 0: every loss and parameter
    (state, losses), (their_state, their_losses) = healed[1], theirs[1]
    assert losses[H:] == their_losses[H:]  # replica 1: from the first sync on
    for name, t in state.items():
        assert torch.equal(t, their_state[name]), name
    own = run_ranks(_engine_rank, 2, 1, False)  # without the heal: another run
    assert any(not torch.equal(t, own[0][0][n]) for n, t in theirs[0][0].items())


# -- a replica that joins late: torchft's live recovery beside engine.ft's ---------------------


def _torchft_manager_replica(replica: int, lighthouse: str, model, steps: int, progress: dict,
                             out: dict):
    """Plain data parallelism under torchft's Manager: every step a quorum, the gradients
    all-reduced over the live replicas, the step committed or not; a replica that joins late
    heals from a peer (torchft's HTTP checkpoint transport, from memory)."""
    import time

    from torchft import Manager, ProcessGroupGloo

    began = time.perf_counter()
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    timeout = datetime.timedelta(seconds=20)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=2, use_async_quorum=False,
        load_state_dict=lambda s: (model.load_state_dict(s["model"]),
                                   optimizer.load_state_dict(s["optimizer"])),
        state_dict=lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
        replica_id=str(replica), store_addr="localhost", store_port=store.port, rank=0,
        world_size=1, lighthouse_addr=lighthouse, port=0, hostname="localhost",
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout)
    first = None
    try:
        while manager.current_step() < steps:
            manager.start_quorum()
            optimizer.zero_grad()
            _loss(model, manager.current_step(), replica).backward()
            for work in [manager.allreduce(p.grad) for p in model.parameters()]:
                work.wait()
            if manager.should_commit():
                optimizer.step()
                first = time.perf_counter() - began if first is None else first
            progress[replica] = manager.current_step()
            time.sleep(0.02)  # a step of some length, so that the late replica meets a round
        out[replica] = (first, _state(model))
    finally:
        manager.shutdown(wait=False)


@pytest.mark.timeout(120)
def test_a_late_replica_heals_from_a_peer_in_torchft_and_in_the_engine():
    import threading
    import time

    from torchft._torchft import LighthouseServer

    from engine.ft import run_with_failure
    from tests.test_ft import _loss as ft_loss, _model as ft_model, _optimizer as ft_optimizer

    steps, join_at = 10, 4
    models = [MLP(SIZES, seed=SEED) for _ in range(3)]
    progress, out = {}, {}
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        threads = [threading.Thread(target=_torchft_manager_replica, args=(
            r, lighthouse.address(), models[r], steps, progress, out)) for r in range(3)]
        for t in threads[:2]:
            t.start()
        give_up = time.monotonic() + 60
        while progress.get(0, 0) < join_at and time.monotonic() < give_up:
            time.sleep(0.01)
        threads[2].start()  # joins at step >= join_at with a model of its own
        for t in threads:
            t.join(timeout=90)
    finally:
        lighthouse.shutdown()
    assert sorted(out) == [0, 1, 2]
    for replica in (1, 2):  # the late replica healed to the survivors' bits and kept them
        for name, t in out[0][1].items():
            assert torch.equal(t, out[replica][1][name]), (replica, name)
    engine = run_with_failure(ft_model, ft_optimizer, ft_loss, replicas=3, steps=10,
                              kill=(2, 3), restart_after=2, deadline_s=2.0, timeout_s=5.0,
                              group_size=2)  # tests/test_ft.py's run
    assert engine.recovery_bit_identical
    # reported, not asserted: torchft's is a thread started in a warm process, the engine's a
    # forked process that also waits for the next round's quorum
    print(f"rejoin, start to first committed step: torchft {out[2][0]:.2f} s, "
          f"engine.ft {engine.rejoin_seconds:.2f} s")
