"""engine.compress: the error-feedback invariant, bytes vs theory, and agreement with PyTorch's
own communication hooks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from engine import theory
from engine.observe.meter import CommMeter
from engine.comm import ops
from engine.compress import BF16, FP16, PowerSGD, RandomK, TopK
from engine.dp import DataParallel
from engine.model.mlp import MLP
from engine.model.data import regression_data, shard
from tests.helpers import BEYOND_CPU, DEVICE_WORLD_SIZES, rank_device, run_ranks

SIZES = (16, 32, 32, 8)


class FakeBucket:
    """A bucket as DataParallel hands it to a compressor."""

    def __init__(self, tensors, index=0, is_last=True):
        self.index, self.is_last = index, is_last
        self.buffer = torch.cat([t.reshape(-1) for t in tensors])
        self.params, self.views, at = [], {}, 0
        for t in tensors:
            p = nn.Parameter(torch.empty_like(t), requires_grad=t.is_floating_point())
            self.params.append(p)
            self.views[p] = self.buffer[at:at + t.numel()].view_as(t)
            at += t.numel()


# -- Top-K ------------------------------------------------------------------------------------

def _error_feedback_invariant(rank, world_size, make):
    torch.manual_seed(rank)
    compressor, results = make(), []
    for _ in range(5):
        grad = torch.randn(1000)
        old = compressor.residuals.get(0, torch.zeros(1000)).clone()
        bucket = FakeBucket([grad.clone()])
        compressor(bucket).wait()
        sent, new = compressor.last_sent[0], compressor.residuals.get(0)
        results.append((torch.equal(sent + new, grad + old) if new is not None else None,
                        int((sent != 0).sum())))
    return results


@pytest.mark.parametrize("make", [lambda: TopK(0.05), lambda: RandomK(0.05)],
                         ids=["topk", "randomk"])
def test_error_feedback_invariant_holds_exactly(make):
    for per_step in run_ranks(_error_feedback_invariant, 2, make):
        assert all(holds for holds, _ in per_step)
        assert all(kept <= 50 for _, kept in per_step)


def test_without_error_feedback_nothing_is_remembered():
    for per_step in run_ranks(_error_feedback_invariant, 2, lambda: TopK(0.05, False)):
        assert all(holds is None for holds, _ in per_step)


def _topk_exchange(rank, world_size, ratio, numel):
    torch.manual_seed(rank)
    grad = torch.randn(numel)
    compressor = TopK(ratio)
    bucket = FakeBucket([grad])
    with CommMeter() as meter:
        compressor(bucket).wait()
    everyone = compressor.last_sent[0].clone()
    dist.all_reduce(everyone)
    return bucket.buffer, everyone / world_size, [
        (e.op, e.payload_bytes, e.bytes_sent, e.dtype) for e in meter.events]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_topk_sends_values_and_indices_and_returns_the_average_of_what_was_sent(world_size):
    numel, ratio = 10_000, 0.01
    k = theory.topk_kept(numel, ratio)
    per_gather = theory.ring_all_gather_bytes(world_size * k * 4, world_size)
    for result, average, events in run_ranks(_topk_exchange, world_size, ratio, numel):
        assert torch.allclose(result, average, atol=1e-6)
        assert [(op, payload) for op, payload, _, _ in events] == [
            ("all_gather", k * 4), ("all_gather", k * 4)]  # this rank's values, indices
        assert "int32" in events[1][3]  # the indices travel too, 4 bytes each
        sent = sum(e[2] for e in events)
        assert sent == 2 * per_gather == theory.topk_bytes_per_rank(numel, ratio, world_size)
    # values + indices at 1% is 2% of the fp32 payload, and grows with N against the ring's
    assert 2 * k * 4 / (numel * 4) == pytest.approx(0.02)


# -- PowerSGD ---------------------------------------------------------------------------------

def _powersgd_once(rank, world_size, make, shapes):
    torch.manual_seed(10 + rank)
    grads = [torch.randn(s) for s in shapes]
    dense = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(dense)
    bucket = FakeBucket(grads)
    with CommMeter() as meter:
        make()(bucket).wait()
    return bucket.buffer, dense / world_size, [e.payload_bytes for e in meter.events]


def test_powersgd_sends_n_plus_m_times_r_instead_of_n_times_m():
    shapes, r = [(64, 32), (64,), (48, 4, 4), (3, 3)], 2
    # (64, 32) and (48, 16) pay off; the vector and the 3 x 3 matrix are sent as they are
    before, after = theory.powersgd_elements(shapes, r)
    assert (before, after) == (64 * 32 + 64 + 48 * 16 + 9, (64 + 32) * r + 64 + (48 + 16) * r + 9)
    for _, _, payloads in run_ranks(_powersgd_once, 2, lambda: PowerSGD(r, start_iter=0),
                                    shapes):
        uncompressed, ps, qs = payloads
        assert uncompressed == (64 + 9) * 4
        assert ps == (64 + 48) * r * 4 and qs == (32 + 16) * r * 4
        assert sum(payloads) == after * 4


def test_powersgd_at_full_rank_reproduces_the_average():
    # forcing compression (min rate 0) at rank min(n, m): P Q^T spans the whole matrix; the
    # only error is fp32 round-off in the orthogonalization, hence atol 1e-5, not 1e-6
    shapes = [(12, 5), (6, 9), (4, 4, 2)]
    for world_size in (2, 3):
        for result, average, _ in run_ranks(
                _powersgd_once, world_size,
                lambda: PowerSGD(9, error_feedback=False, min_compression_rate=0, start_iter=0),
                shapes):
            assert torch.allclose(result, average, atol=1e-5)


def test_powersgd_at_low_rank_is_an_approximation():
    for result, average, _ in run_ranks(_powersgd_once, 2, lambda: PowerSGD(1, start_iter=0),
                                        [(32, 32)]):
        assert not torch.allclose(result, average, atol=1e-2)


# -- on each device ----------------------------------------------------------------------------

COMPRESSORS = {"fp16": (FP16, 2**-10), "bf16": (BF16, 2**-7), "topk": (lambda: TopK(0.1), 0.0),
               "powersgd": (lambda: PowerSGD(8, start_iter=0), 1e-5)}


def _compressors_on(rank, world_size, device):
    """Each compressor once on a bucket living on ``device``: the result must be the average
    of what the ranks sent (exact for Top-K, full-rank PowerSGD to round-off, the casts to
    their precision), and stay on that device."""
    on = rank_device(device)
    worst = {}
    for name, (make, rtol) in COMPRESSORS.items():
        torch.manual_seed(20 + rank)
        grads = [torch.randn(8, 8).to(on), torch.randn(40).to(on)]
        bucket = FakeBucket(grads)
        dense = bucket.buffer.clone()
        compressor = make()
        compressor(bucket).wait()
        if name == "topk":  # the average of what was sent, values and indices
            expected = compressor.last_sent[0].clone()
        else:
            expected = dense
        ops.all_reduce(expected)  # Gloo and NCCL both take CUDA tensors here
        expected /= world_size
        scale = expected.abs().max().item()
        worst[name] = ((bucket.buffer - expected).abs().max().item() / scale, rtol,
                       bucket.buffer.device == on)
    return worst


@pytest.mark.parametrize("device", BEYOND_CPU)
@pytest.mark.parametrize("world_size", DEVICE_WORLD_SIZES)
def test_every_compressor_returns_the_average_on_each_device(device, world_size):
    for worst in run_ranks(_compressors_on, world_size, device, device=device):
        for name, (error, rtol, stayed) in worst.items():
            assert stayed, f"{name}: the bucket left its device"
            assert error <= 2 * rtol, f"{name}: relative error {error:.2e}"


# -- against PyTorch's hooks ------------------------------------------------------------------

def _train_both(rank, world_size, kind, steps):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    x, y = regression_data(8 * world_size, SIZES[0], SIZES[-1], seed=1)
    xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
    if kind == "fp16":
        ours = DataParallel(MLP(SIZES, seed=4), compressor=FP16())
        theirs = nn.parallel.DistributedDataParallel(MLP(SIZES, seed=4))
        theirs.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        ours = DataParallel(MLP(SIZES, seed=4), compressor=PowerSGD(1, start_iter=2))
        theirs = nn.parallel.DistributedDataParallel(MLP(SIZES, seed=4))
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2)
        theirs.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    worst = []
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for _ in range(steps):
        for model, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            nn.functional.mse_loss(model(xs), ys).backward()
            opt.step()
        worst.append(max((a - b).abs().max().item() for a, b in
                         zip(ours.parameters(), theirs.parameters(), strict=True)))
    return worst


def test_fp16_matches_pytorchs_fp16_compress_hook():
    for worst in run_ranks(_train_both, 2, "fp16", 4):
        assert max(worst) <= 1e-6  # the same casts and the same sums: equal to fp32 round-off


def _fp16_gradients(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    x, y = regression_data(8 * world_size, SIZES[0], SIZES[-1], seed=1)
    xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
    ours = DataParallel(MLP(SIZES, seed=4), compressor=FP16())
    theirs = nn.parallel.DistributedDataParallel(MLP(SIZES, seed=4))
    theirs.register_comm_hook(None, default_hooks.fp16_compress_hook)
    for model in (ours, theirs):
        nn.functional.mse_loss(model(xs), ys).backward()
    return [(a.grad, b.grad) for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)]


def test_fp16_at_three_ranks_differs_from_pytorchs_hook_only_at_fp16_resolution():
    # three fp16 addends round differently in different orders, and Gloo's order depends on
    # where an element sits in the bucket, which DDP lays out its own way. Where the addends
    # cancel, a few ulps of the small result; at the scale of the tensor, below one fp16 step
    # (2^-10 relative): a summation-order effect, not a different algorithm
    for pairs in run_ranks(_fp16_gradients, 3):
        for ours, theirs in pairs:
            assert (ours - theirs).abs().max() <= 2**-10 * theirs.abs().max()
            assert torch.equal(ours.half().float() == ours, torch.ones_like(ours, dtype=bool))


@pytest.mark.parametrize("world_size", [2, 3])
def test_powersgd_follows_pytorchs_powersgd_hook(world_size):
    # same rank, error feedback, warm start, seed: the same trajectory; 1e-5 allows for
    # matmul vs bmm round-off over 8 steps, a hundred times below a step's size (lr 0.1)
    for worst in run_ranks(_train_both, world_size, "powersgd", 8):
        assert max(worst) <= 1e-5


# -- casts and bad input --------------------------------------------------------------------

def _cast(rank, world_size, make):
    torch.manual_seed(rank)
    grad = torch.randn(1000)
    dense = grad.clone()
    dist.all_reduce(dense)
    bucket = FakeBucket([grad])
    with CommMeter() as meter:
        make()(bucket).wait()
    return bucket.buffer, dense / world_size, meter.events[0].payload_bytes


@pytest.mark.parametrize("make, rtol", [(FP16, 2**-10), (BF16, 2**-7)], ids=["fp16", "bf16"])
def test_casts_halve_the_bytes_within_their_precision(make, rtol):
    for result, average, payload in run_ranks(_cast, 2, make):
        assert payload == 1000 * 2
        assert torch.allclose(result, average, rtol=rtol, atol=rtol)
        assert not torch.equal(result, average)


@pytest.mark.parametrize("make, message", [
    (lambda: TopK(0), "ratio must be a number in \\(0, 1\\]"),
    (lambda: TopK(1.5), "got 1.5"),
    (lambda: RandomK(-0.1), "got -0.1"),
    (lambda: PowerSGD(0), "PowerSGD rank must be a positive int, got 0"),
    (lambda: PowerSGD(1.5), "got 1.5"),
])
def test_bad_settings_are_clear_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("make", [FP16, lambda: TopK(0.1),
                                  lambda: PowerSGD(1, start_iter=0)])
def test_integer_gradients_are_a_clear_error(make):
    bucket = FakeBucket([torch.arange(10)])
    with pytest.raises(ValueError, match="floating-point gradients, got a bucket of torch.int64"):
        make()(bucket)


# -- the convergence experiment's plumbing ---------------------------------------------------

@pytest.mark.parametrize("spec, message", [
    ("topk", "unknown compressor spec 'topk'"),
    ("topk:2", "bad compressor spec 'topk:2': ratio must be a number in \\(0, 1\\]"),
    ("powersgd:0", "bad compressor spec 'powersgd:0'"),
    ("gzip", "unknown compressor spec 'gzip'"),
])
def test_bad_compressor_specs_are_clear_errors(spec, message):
    from engine.compress.spec import make_compressor

    with pytest.raises(ValueError, match=message):
        make_compressor(spec)


def test_experiment_counts_topk_bytes_as_n_times_the_ratio_of_dense():
    from engine.labs.compression import STUDENT, train_compressed

    numel = sum(p.numel() for p in MLP(STUDENT).parameters())  # one bucket
    for world_size in (2, 3):
        results = run_ranks(train_compressed, world_size, "topk:0.01", 5)
        k = theory.topk_kept(numel, 0.01)
        for r in results:
            assert r["bytes_sent"] == 5 * theory.topk_bytes_per_rank(numel, 0.01, world_size)
            assert r["bytes_sent"] / r["dense_bytes"] == pytest.approx(world_size * k / numel)
            assert len(r["losses"]) == 1 and 0 <= r["accuracy"] <= 1


def test_powersgd_defaults_are_pytorchs():
    """Read from PyTorch's own PowerSGDState, not from a typed copy."""
    import inspect

    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    theirs = {name: p.default for name, p in
              inspect.signature(PowerSGDState.__init__).parameters.items()}
    ours = {name: p.default for name, p in inspect.signature(PowerSGD.__init__).parameters.items()}
    same_as = {"rank": "matrix_approximation_rank", "start_iter": "start_powerSGD_iter",
               "min_compression_rate": "min_compression_rate",
               "error_feedback": "use_error_feedback", "warm_start": "warm_start",
               "seed": "random_seed"}
    assert set(same_as) == set(ours) - {"self"}
    for mine, pytorch in same_as.items():
        assert ours[mine] == theirs[pytorch], (mine, ours[mine], pytorch, theirs[pytorch])
