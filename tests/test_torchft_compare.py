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
