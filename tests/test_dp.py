"""Data parallelism: equal to one process on the full batch, and to torch DDP, after K steps."""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn

from engine.observe.meter import CommMeter
from engine.dp import DataParallel, NaiveDataParallel, assign_buckets
from engine.model.mlp import MLP
from engine.model.data import regression_data, shard
from tests.helpers import BEYOND_CPU, DEVICE_WORLD_SIZES, rank_device, run_ranks

SIZES = (16, 64, 64, 8)  # 6 parameter tensors, 5.7 K parameters: 23 KB of fp32 gradients
STEPS = 3
# bucket caps (MB) forcing one bucket, two, and one per parameter tensor
CAPS = {"1 bucket": 1.0, "2 buckets": 0.012, "6 buckets": 1e-6}


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _train(model, opt, x, y, steps=STEPS):
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _equivalence(rank, world_size, wrapper, cap, overlap, opt_kind, device="cpu"):
    on = rank_device(device)
    x, y = (t.to(on) for t in regression_data(12 * world_size, 16, 8, seed=1))
    reference = MLP(SIZES, seed=3).to(on)
    _train(reference, _optimizer(opt_kind, reference.parameters()), x, y)

    local = MLP(SIZES, seed=100 + rank).to(on)  # every rank starts elsewhere...
    if rank == 0:
        local.load_state_dict(MLP(SIZES, seed=3).state_dict())  # ...the broadcast must fix it
    if wrapper == "engine":
        model = DataParallel(local, bucket_cap_mb=cap, overlap=overlap)
    elif wrapper == "naive":
        model = NaiveDataParallel(local)
    else:  # torch DDP also broadcasts rank 0's parameters at construction
        model = nn.parallel.DistributedDataParallel(local, bucket_cap_mb=cap)
    with CommMeter() as meter:
        _train(model, _optimizer(opt_kind, model.parameters()), shard(x, rank, world_size),
               shard(y, rank, world_size))
    worst = max((a - b).abs().max().item()
                for a, b in zip(local.parameters(), reference.parameters(), strict=True))
    return worst, len([e for e in meter.events if e.op == "all_reduce"])


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("cap_name", list(CAPS))
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("opt_kind", ["sgd", "adamw"])
def test_data_parallel_equals_single_process_full_batch(world_size, cap_name, overlap, opt_kind):
    expected_buckets = {"1 bucket": 1, "2 buckets": 2, "6 buckets": 6}[cap_name]
    for worst, all_reduces in run_ranks(_equivalence, world_size, "engine", CAPS[cap_name],
                                        overlap, opt_kind):
        assert worst <= 1e-6
        assert all_reduces == STEPS * expected_buckets


@pytest.mark.parametrize("device", BEYOND_CPU)
@pytest.mark.parametrize("world_size", DEVICE_WORLD_SIZES)
def test_data_parallel_equals_single_process_on_each_device(device, world_size):
    for worst, all_reduces in run_ranks(_equivalence, world_size, "engine", CAPS["2 buckets"],
                                        True, "adamw", device, device=device):
        assert worst <= 1e-6
        assert all_reduces == STEPS * 2


@pytest.mark.parametrize("wrapper", ["naive", "torch"])
def test_naive_and_torch_ddp_agree_with_the_same_reference(wrapper):
    for worst, all_reduces in run_ranks(_equivalence, 3, wrapper, 0.012, True, "adamw"):
        assert worst <= 1e-6
        if wrapper == "naive":
            assert all_reduces == STEPS * 6  # one per parameter tensor


def _accumulate(rank, world_size, k):
    x, y = regression_data(8 * k * world_size, 16, 8, seed=2)
    xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
    reference = MLP(SIZES, seed=3)
    nn.functional.mse_loss(reference(x), y).backward()
    model = DataParallel(MLP(SIZES, seed=3), bucket_cap_mb=0.012)
    with CommMeter() as meter:
        for i, (xi, yi) in enumerate(zip(xs.chunk(k), ys.chunk(k), strict=True)):
            loss = nn.functional.mse_loss(model(xi), yi) / k
            if i < k - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
    worst = max((p.grad - q.grad).abs().max().item() for p, q in
                zip(model.module.parameters(), reference.parameters(), strict=True))
    return worst, len(meter.events)


def test_no_sync_accumulation_equals_one_big_batch_with_k_times_fewer_all_reduces():
    k = 4
    for worst, events in run_ranks(_accumulate, 2, k):
        assert worst <= 1e-6
        assert events == 2  # two buckets, once: not k times


class _Tricky(nn.Module):
    """A frozen layer, a branch used only on rank 0, and a weight tied between two layers."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.sometimes = nn.Linear(4, 4)

    def forward(self, x, use_branch):
        h = self.b(self.a(self.frozen(x)))
        return self.sometimes(h) if use_branch else h


def _tricky(rank, world_size):
    torch.manual_seed(0)
    model = DataParallel(_Tricky(), bucket_cap_mb=1e-6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    frozen_before = model.module.frozen.weight.clone()
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(2, 4) * (rank + 1), use_branch=rank == 0).sum().backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.module.parameters()])
    return flat, torch.equal(model.module.frozen.weight, frozen_before), \
        model.module.frozen.weight.grad is None


def test_frozen_unused_and_tied_parameters_keep_replicas_identical():
    results = run_ranks(_tricky, 3)
    for flat, frozen_same, frozen_no_grad in results:
        assert frozen_same and frozen_no_grad
        assert torch.equal(flat, results[0][0])  # every replica took the same step


def test_buckets_are_filled_in_reverse_order():
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 20, 30, 40)]
    buckets = assign_buckets(params, cap_bytes=200)
    assert [[p.numel() for p in b] for b in buckets] == [[40, 30], [20, 10]]
    first_small = assign_buckets(params, cap_bytes=10_000, first_cap_bytes=100)
    assert [[p.numel() for p in b] for b in first_small] == [[40], [30, 20, 10]]


@pytest.mark.parametrize("make, message", [
    (lambda: DataParallel(nn.Linear(2, 2), bucket_cap_mb=0), "bucket_cap_mb must be a positive"),
    (lambda: DataParallel(nn.Linear(2, 2), bucket_cap_mb=True),
     "bucket_cap_mb must be a positive number, got True"),
    (lambda: DataParallel(nn.Linear(2, 2), first_bucket_mb=-1),
     "first_bucket_mb must be a positive number, got -1"),
    (lambda: DataParallel(nn.ReLU()), "ReLU has no parameters"),
    (lambda: DataParallel(nn.Linear(2, 2), compressor=3), "compressor must be None or callable"),
])
def test_bad_input_is_a_clear_error(make, message):
    def rank_fn(rank, world_size):
        make()

    with pytest.raises(Exception, match=message):
        run_ranks(rank_fn, 2)


def test_mixed_devices_are_a_clear_error():
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to("meta"))
    with pytest.raises(ValueError, match="parameters are on several devices"):
        DataParallel(module)


def _compressed(rank, world_size):
    calls = []

    def plain_average(bucket, group):
        calls.append((bucket.index, bucket.is_last, bucket.buffer.numel()))
        bucket.buffer.div_(dist.get_world_size(group))
        return dist.all_reduce(bucket.buffer, group=group, async_op=True)

    model = DataParallel(MLP(SIZES, seed=3), bucket_cap_mb=0.012, compressor=plain_average)
    reference = DataParallel(MLP(SIZES, seed=3), bucket_cap_mb=0.012)
    x, y = regression_data(8, 16, 8, seed=rank)
    for m in (model, reference):
        nn.functional.mse_loss(m(x), y).backward()
    same = all(torch.equal(a.grad, b.grad) for a, b in
               zip(model.parameters(), reference.parameters(), strict=True))
    return calls, same


def test_the_compressor_slot_receives_every_bucket_and_returns_the_average():
    for calls, same in run_ranks(_compressed, 2):
        assert [c[:2] for c in calls] == [(0, False), (1, True)]
        assert sum(c[2] for c in calls) == sum(p.numel() for p in MLP(SIZES).parameters())
        assert same


def _defaults(rank, world_size, kwargs):
    ours = DataParallel(MLP(SIZES), **kwargs)
    theirs = nn.parallel.DistributedDataParallel(MLP(SIZES), **kwargs)
    return ((ours.bucket_cap_bytes, ours.first_bucket_bytes, ours.broadcast_buffers),
            (theirs.bucket_bytes_cap, theirs._bucket_config.first_bucket_bytes_cap,
             theirs.broadcast_buffers))


def test_defaults_are_pytorchs_ddp_defaults():
    ours = inspect.signature(DataParallel).parameters
    theirs = inspect.signature(nn.parallel.DistributedDataParallel).parameters
    for mine, torch_name in {"bucket_cap_mb": "bucket_cap_mb", "group": "process_group"}.items():
        assert ours[mine].default == theirs[torch_name].default, mine
    # what the defaults resolve to (25 MiB buckets, a 1 MiB first bucket, buffers broadcast
    # every forward), and that an explicit cap drops the small first bucket, in both
    for kwargs in ({}, {"bucket_cap_mb": 5}):
        for mine, torchs in run_ranks(_defaults, 1, kwargs):
            assert mine == torchs, kwargs


def test_default_buckets_are_the_ones_pytorch_assigns():
    """PyTorch's own bucketing function with its default caps: DDP buckets by it in the order
    gradients arrive, which for an MLP is the reverse of the parameters."""
    from torch.nn.parallel.distributed import _BucketCapacityConfig

    caps = _BucketCapacityConfig.create(None, None, False)
    params = list(MLP((512, 1024, 1024, 8)).parameters())  # 6.3 MB: the first bucket matters
    position = {id(p): i for i, p in enumerate(reversed(params))}
    theirs, _ = dist._compute_bucket_assignment_by_size(
        [p.detach() for p in reversed(params)],
        [caps.first_bucket_bytes_cap, caps.bucket_bytes_cap])
    ours = assign_buckets(params, *_resolved_caps())
    assert [[position[id(p)] for p in bucket] for bucket in ours] == theirs
    assert len(theirs) == 2  # the 1 MiB first bucket, then the rest


def _resolved_caps():
    """The caps ``DataParallel()`` uses, built on a one-rank group."""
    def rank_fn(rank, world_size):
        model = DataParallel(MLP(SIZES))
        return model.bucket_cap_bytes, model.first_bucket_bytes

    return run_ranks(rank_fn, 1)[0]


def _batch_norm(rank, world_size, broadcast_buffers):
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))

    ours = DataParallel(make(), bucket_cap_mb=1.0, broadcast_buffers=broadcast_buffers)
    theirs = nn.parallel.DistributedDataParallel(make(), bucket_cap_mb=1.0)
    for model in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):  # each rank's batches differ, so do its running statistics
            torch.manual_seed(10 * rank + step)
            opt.zero_grad()
            # PyTorch skips the broadcast in the forward after one under no_sync(): the last
            with model.no_sync() if step == 1 else contextlib.nullcontext():
                model(torch.randn(8, 4) * (rank + 1)).square().mean().backward()
            opt.step()
    return [b.clone() for b in ours.module.buffers()], [b.clone() for b in theirs.module.buffers()]


def test_buffers_are_broadcast_at_each_forward_as_pytorch_does():
    for ours, theirs in run_ranks(_batch_norm, 2, True):
        for a, b in zip(ours, theirs, strict=True):
            assert torch.allclose(a, b, atol=1e-6)
    # without the broadcast, rank 1 keeps statistics of its own batches only: not PyTorch's
    ours, theirs = run_ranks(_batch_norm, 2, False)[1]
    assert not torch.allclose(ours[0], theirs[0], atol=1e-3)


def _first_launch_vs_backward_end(rank, world_size, overlap):
    model = DataParallel(MLP((64, 256, 256, 256, 256, 8), seed=0), bucket_cap_mb=0.2,
                         overlap=overlap)
    x, y = regression_data(64, 64, 8, seed=rank)
    with CommMeter() as meter:
        nn.functional.mse_loss(model(x), y).backward()
    starts = [e.start for e in meter.events if e.op == "all_reduce"]
    return len(starts), min(starts) < model.backward_done_at, max(starts) < \
        model.backward_done_at


def test_overlap_starts_the_first_all_reduce_before_backward_ends():
    for count, first_before, last_before in run_ranks(_first_launch_vs_backward_end, 2, True):
        assert count >= 3 and first_before  # communication began while backward computed
    for count, first_before, _ in run_ranks(_first_launch_vs_backward_end, 2, False):
        assert count >= 3 and not first_before  # without overlap, all of it waits for the end


def _against_torch_ddp(rank, world_size, cap, overlap):
    x, y = regression_data(10 * world_size, 16, 8, seed=5)
    xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
    ours = DataParallel(MLP(SIZES, seed=3), bucket_cap_mb=cap, overlap=overlap)
    theirs = nn.parallel.DistributedDataParallel(MLP(SIZES, seed=3), bucket_cap_mb=cap)
    for model in (ours, theirs):
        _train(model, _optimizer("adamw", model.parameters()), xs, ys)
    return max((a - b).abs().max().item() for a, b in
               zip(ours.module.parameters(), theirs.module.parameters(), strict=True))


@pytest.mark.parametrize("world_size, cap, overlap", [(2, 1.0, True), (3, 0.012, False),
                                                       (4, 1e-6, True)])
def test_data_parallel_equals_torch_ddp_directly(world_size, cap, overlap):
    assert max(run_ranks(_against_torch_ddp, world_size, cap, overlap)) <= 1e-6


def _averaging_vs_gradients(rank, world_size, opt_kind):
    from engine.dp import average_parameters

    x, y = regression_data(8 * world_size, 16, 8, seed=7)
    xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
    grads = DataParallel(MLP(SIZES, seed=3), bucket_cap_mb=1.0)
    grad_opt = _optimizer(opt_kind, grads.parameters())
    params = MLP(SIZES, seed=3)
    param_opt = _optimizer(opt_kind, params.parameters())
    for _ in range(3):
        _train(grads, grad_opt, xs, ys, steps=1)
        _train(params, param_opt, xs, ys, steps=1)  # a purely local step...
        average_parameters(params)  # ...then the parameters are averaged
    diff = max((a - b).abs().max().item() for a, b in
               zip(grads.module.parameters(), params.parameters(), strict=True))
    moments = torch.cat([s["exp_avg"].flatten() for s in param_opt.state.values()]) \
        if opt_kind == "adamw" else torch.zeros(1)
    return diff, moments


def test_parameter_averaging_is_not_gradient_averaging_for_adam():
    results = run_ranks(_averaging_vs_gradients, 3, "adamw")
    assert all(diff > 1e-4 for diff, _ in results)  # different models after 3 steps
    assert not torch.equal(results[0][1], results[1][1])  # and the Adam moments drifted apart


def test_for_plain_sgd_averaging_parameters_every_step_is_the_same():
    def rank_fn(rank, world_size):
        x, y = regression_data(8 * world_size, 16, 8, seed=7)
        xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
        from engine.dp import average_parameters

        grads = DataParallel(MLP(SIZES, seed=3), bucket_cap_mb=1.0)
        params = MLP(SIZES, seed=3)
        for model in (grads, params):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                _train(model, opt, xs, ys, steps=1)
                if model is params:
                    average_parameters(params)
        return max((a - b).abs().max().item() for a, b in
                   zip(grads.module.parameters(), params.parameters(), strict=True))

    assert max(run_ranks(rank_fn, 3)) <= 1e-6  # linear update: mean of steps = step of mean


def test_local_sgd_averages_every_period_steps():
    def rank_fn(rank, world_size):
        from engine.dp import LocalSGD

        model = MLP(SIZES, seed=rank)
        local = LocalSGD(model, period=3)
        with CommMeter() as meter:
            averaged = [local.step() for _ in range(7)]
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        return averaged, len(meter.events), flat

    results = run_ranks(rank_fn, 2)
    for averaged, events, flat in results:
        assert averaged == [False, False, True, False, False, True, False]
        assert events == 2 * 6  # two averages of 6 tensors
        assert torch.equal(flat, results[0][2])  # replicas equal right after an average
    with pytest.raises(ValueError, match="period \\(local steps between averages\\) must be a positive int"):
        from engine.dp import LocalSGD

        LocalSGD(nn.Linear(2, 2), period=0)


def _sequential_sgd(steps, lr, staleness, batch=16, seed=0):
    """One worker, by hand: what the parameter server must reproduce exactly."""
    from torch.nn.utils import parameters_to_vector

    from engine.dp.async_ps import SIZES, _loss_and_grad

    model = MLP(SIZES, seed=seed)
    x, y = regression_data(64, SIZES[0], SIZES[-1], seed=seed)
    server = parameters_to_vector(model.parameters()).detach().clone()
    local, losses = server.clone(), []
    for step in range(steps):
        start = (step * batch) % x.size(0)
        _, grad = _loss_and_grad(model, local, x[start:start + batch], y[start:start + batch])
        server -= lr * grad
        losses.append(_loss_and_grad(model, server, x, y)[0])
        if (step + 1) % (staleness + 1) == 0:
            local = server.clone()
    return losses


@pytest.mark.parametrize("staleness", [0, 3])
def test_async_sgd_with_one_worker_is_exactly_sgd_on_stale_parameters(staleness):
    from engine.dp import async_sgd

    run = run_ranks(async_sgd, 2, 20, 0.1, staleness)[0]
    assert run["losses"] == pytest.approx(_sequential_sgd(20, 0.1, staleness), abs=1e-6)
    # one worker: the knob is the only source of staleness, 0, 1, ..., s, 0, 1, ...
    assert run["staleness"] == [i % (staleness + 1) for i in range(20)]


def test_staler_gradients_train_worse_and_bounded_staleness_completes():
    from engine.dp import async_sgd

    fresh = _sequential_sgd(40, 0.3, staleness=0)[-1]
    stale = _sequential_sgd(40, 0.3, staleness=8)[-1]
    assert stale > fresh
    # three workers in lock-step (bound 0), one of them slow: every worker pushes once per
    # round, and a gradient can only be behind the other two of its round
    run = run_ranks(async_sgd, 4, 30, 0.1, 0, 0, 0.002)[0]
    assert len(run["losses"]) == 30 and run["losses"][-1] < run["losses"][0]
    assert run["pushes"] == {1: 10, 2: 10, 3: 10}
    assert max(run["staleness"]) <= 2
    # fully asynchronous with the same straggler: still exactly 30 updates, clean shutdown
    run = run_ranks(async_sgd, 4, 30, 0.1, 0, None, 0.002)[0]
    assert len(run["losses"]) == 30 and sum(run["pushes"].values()) == 30
    with pytest.raises(Exception, match="needs a server and at least one worker"):
        run_ranks(async_sgd, 1)
