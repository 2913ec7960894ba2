"""engine.optim: Muon against Keller Jordan's update, DistributedMuon against Muon on 2 and 4
ranks, the naive row-shard version measured wrong, bytes against ZeRO-2 AdamW, Newton-Schulz
FLOPs counted."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from engine import theory
from engine.optim import (COEFFICIENTS, Muon, assign_owners, naive_error, newton_schulz,
                          newton_schulz_flops, split_params)
from engine.labs.muon import muon_vs_zero2, single_muon
from tests.helpers import run_ranks

pytestmark = pytest.mark.filterwarnings("error")

SIZES = ((16, 32), (32, 24), (24, 24), (24, 8))  # Linear(in, out) without bias
ROWS, STEPS, LR = 16, 3, 0.02


def _net():
    torch.manual_seed(0)
    layers = [nn.Linear(i, o, bias=False) for i, o in SIZES]
    return nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())][:-1])


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 16, generator=g), torch.randn(ROWS, 8, generator=g)


def _keller_jordan_step(params, buffers, lr=LR, beta=0.95):
    """Transcribed from github.com/KellerJordan/Muon (muon.py), in fp32."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    for p, buf in zip(params, buffers):
        grad = p.grad
        buf.lerp_(grad, 1 - beta)
        update = grad.lerp(buf, beta)
        x = update.T if update.size(-2) > update.size(-1) else update
        x = x / (x.norm() + 1e-7)
        for _ in range(5):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        x = x.T if update.size(-2) > update.size(-1) else x
        x = x * max(1, grad.size(-2) / grad.size(-1)) ** 0.5
        with torch.no_grad():
            p.add_(x, alpha=-lr)


def _train(model, step, x, y, steps=STEPS):
    for _ in range(steps):
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        step()
    return [p.detach().clone() for p in model.parameters()]


def test_newton_schulz_orthogonalises_and_its_flops_are_counted():
    assert COEFFICIENTS == (3.4445, -4.7750, 2.0315)
    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        o = newton_schulz(g)
    singular = torch.linalg.svdvals(o)
    assert 0.6 < singular.min() and singular.max() < 1.25  # near 1, not exactly (by design)
    assert counter.get_total_flops() == newton_schulz_flops(24, 40) == 5 * (4 * 24**2 * 40
                                                                            + 2 * 24**3)
    assert newton_schulz(g.T).T.allclose(o, atol=1e-6)  # tall: transposed, the same


def test_muon_is_keller_jordans_update():
    x, y = _data()
    ours = _net()
    optimizer = Muon(ours.parameters(), lr=LR)
    theirs = _net()
    buffers = [torch.zeros_like(p) for p in theirs.parameters()]
    a = _train(ours, optimizer.step, x, y)
    b = _train(theirs, lambda: _keller_jordan_step(list(theirs.parameters()), buffers), x, y)
    for p, q in zip(a, b):
        assert torch.equal(p, q)


@pytest.mark.parametrize("make", ["Muon", "DistributedMuon", "GatherMuon"])
@pytest.mark.parametrize("bad, match", [(dict(lr=0.0), "lr must be positive, got 0.0"),
                                        (dict(momentum=1.0), r"momentum must be in \[0, 1\)")])
def test_every_muon_refuses_a_bad_lr_or_momentum_before_anything_else(make, bad, match):
    import engine.optim as optim

    with pytest.raises(ValueError, match=match):  # no process group needed to hear it
        getattr(optim, make)([nn.Parameter(torch.ones(4, 4))], **bad)


def test_muon_refuses_a_vector_and_points_to_adamw():
    with pytest.raises(ValueError, match=r"parameter 1 of group 0 has shape \(4,\).*AdamW"):
        Muon([nn.Parameter(torch.ones(4, 4)), nn.Parameter(torch.ones(4))])
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    matrices, rest = split_params(model)
    assert [tuple(p.shape) for p in matrices] == [(8, 8)]
    assert len(rest) == 4  # the embedding, the bias, the norm's weight and bias


@pytest.mark.parametrize("world_size", [2, 4])
def test_distributed_muon_equals_muon(world_size):
    # the ranks take one metered step, then STEPS more
    single_params = single_muon(STEPS + 1, ROWS, SIZES, LR)
    psi = sum(i * o for i, o in SIZES)
    results = run_ranks(muon_vs_zero2, world_size, STEPS, ROWS, SIZES, LR)
    total_flops = sum(newton_schulz_flops(o, i) for i, o in SIZES)
    assert sum(r.ns_flops for r in results) == (STEPS + 1) * total_flops  # each matrix once
    for r in results:
        worst = max((p - q).abs().max().item() for p, q in zip(r.params, single_params))
        print(f"{world_size} ranks: |distributed - single| {worst:.2e}; bytes a step: Muon "
              f"{r.muon_bytes}, ZeRO-2 AdamW {r.zero2_bytes}; NS FLOPs "
              f"{r.ns_flops // (STEPS + 1)} of {total_flops}; segment {r.segment} of psi/N "
              f"{psi / world_size:.0f}")
        assert worst <= 1e-6
        # ZeRO-2's reduce-scatter + all-gather of psi, the segments padded to the largest
        assert r.zero2_bytes == theory.zero_comm_elements(psi, world_size, 2) * 4
        assert r.muon_bytes == round(2 * (world_size - 1) * r.segment * 4)


@pytest.mark.parametrize("world_size", [2, 4])
def test_owner_and_moonlight_gather_side_by_side_bytes_and_flops_per_rank_as_theory(world_size):
    """Issue 42: the owner scheme (Keller Jordan's, Essential AI's) and Moonlight's Algorithm 1
    (every matrix gathered and orthogonalised on every rank), counted on real ranks against
    engine.theory's formulas."""
    single_params = single_muon(STEPS + 1, ROWS, SIZES, LR)
    shapes = [(o, i) for i, o in SIZES]  # nn.Linear(i, o).weight is o x i
    psi = sum(o * i for o, i in shapes)
    owners = assign_owners([o * i for o, i in shapes], world_size)
    largest = max(sum(o * i for (o, i), w in zip(shapes, owners) if w == r)
                  for r in range(world_size))
    for rank, r in enumerate(run_ranks(muon_vs_zero2, world_size, STEPS, ROWS, SIZES, LR)):
        worst = max((p - q).abs().max().item() for p, q in zip(r.gather_params, single_params))
        assert worst <= 1e-6  # the same steps as one process, like the owner scheme's
        assert r.steps == STEPS + 1
        assert r.muon_bytes == theory.muon_step_bytes("owner", psi, world_size, largest)
        assert r.gather_bytes == theory.muon_step_bytes("gather", psi, world_size)
        mine = [i for i, w in enumerate(owners) if w == rank]
        assert r.ns_flops == r.steps * theory.muon_ns_flops_per_rank("owner", shapes, mine)
        assert r.gather_ns_flops == r.steps * theory.muon_ns_flops_per_rank("gather", shapes)
        assert r.gather_ns_flops == r.steps * sum(newton_schulz_flops(*s) for s in shapes)
        assert r.chunk == -(-psi // world_size)
    # at 2 ranks the owner scheme sends less; at 4 its padding to the busiest owner (768 of
    # 2048 elements, 1.5x psi/4) costs exactly Moonlight's third collective
    owner, gather = (theory.muon_step_bytes("owner", psi, world_size, largest),
                     theory.muon_step_bytes("gather", psi, world_size))
    assert (owner < gather) if world_size == 2 else (owner == gather)


def test_the_naive_row_shard_muon_is_wrong():
    m = torch.randn(32, 24, generator=torch.Generator().manual_seed(0))
    errors = {n: naive_error(m, n) for n in (2, 4)}
    print("naive row-shard Newton-Schulz, relative error:", errors)
    assert min(errors.values()) > 0.3
    assert naive_error(m, 1) == 0.0


def test_owners_balance_the_matrices():
    assert assign_owners([100, 10, 60, 50], 2) == [0, 0, 1, 1]  # 110 elements each
    assert assign_owners([5], 3) == [0]
