"""The state-accounting contract: ``engine.observe.memory.model_state_bytes`` counts what every strategy
holds on each of 2 ranks, and refuses what it cannot count.

Every expected number here is written from the dense model's shapes and the ZeRO paper's
formula (``engine.theory.zero_model_state_bytes``), never read back from the strategy: the
model's layers have an even number of elements, so no bucket or unit is padded at N = 2 and
the formula is exact, plus Adam's ``step`` counter (one 4-byte float per tensor it updates).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from engine import theory
from engine.dp import DataParallel, NaiveDataParallel
from engine.observe.memory import model_state_bytes
from engine.model.mlp import MLP
from engine.zero import TunedZeroOptimizer, ZeroDataParallel, ZeroOptimizer
from tests.helpers import run_ranks

N = 2
SIZES = (16, 32, 8)  # Linear(16, 32) and Linear(32, 8): 544 + 264 elements, each even
LAYERS = [16 * 32 + 32, 32 * 8 + 8]
PSI = sum(LAYERS)
TENSORS = 4  # two weights, two biases
STEP = 4  # Adam's step counter: one float32 per tensor it updates


def _one_step(model, optimizer, rank, dtype=torch.float32):
    torch.manual_seed(rank)
    x, y = torch.randn(4, SIZES[0], dtype=dtype), torch.randn(4, SIZES[-1], dtype=dtype)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def _fields(held) -> dict:
    return {k: v for k, v in dataclasses.asdict(held).items() if not k.startswith("max_memory")
            and k != "memory_allocated"}


# -- each strategy, on every rank: {way of asking: StateBytes as a dict} ----------------------

def _plain(rank, world_size):
    model = MLP(SIZES, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _one_step(model, opt, rank)
    return {"model, optimizer": _fields(model_state_bytes(model, opt))}


def _naive_dp(rank, world_size):
    model = NaiveDataParallel(MLP(SIZES, seed=0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _one_step(model, opt, rank)
    return {"wrapper, optimizer": _fields(model_state_bytes(model, opt))}


def _dp(rank, world_size):
    model = DataParallel(MLP(SIZES, seed=0), bucket_cap_mb=1.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _one_step(model, opt, rank)
    return {"wrapper, optimizer": _fields(model_state_bytes(model, opt))}


def _zero(rank, world_size, stage, offload, dtype, optimizer=ZeroOptimizer):
    model = MLP(SIZES, seed=0).to(dtype)
    opt = optimizer(model.parameters(), torch.optim.Adam, stage=stage, offload=offload,
                    bucket_cap_mb=1.0, lr=1e-3)  # one bucket
    _one_step(model, opt, rank, dtype)
    return {"model, optimizer": _fields(model_state_bytes(model, opt))}


def _zero3(rank, world_size, dtype):
    model = ZeroDataParallel(MLP(SIZES, seed=0).to(dtype), torch.optim.Adam, lr=1e-3)
    _one_step(model, model.optimizer, rank, dtype)
    return {way: _fields(model_state_bytes(*holders)) for way, holders in {
        "wrapper": (model,), "wrapper, .optimizer": (model, model.optimizer),
        "inner module": (model.module,), "inner module, .optimizer": (model.module,
                                                                      model.optimizer)}.items()}


def _tp(rank, world_size):
    from engine.tp import ColumnParallelLinear, RowParallelLinear

    first, second = nn.Linear(16, 32), nn.Linear(32, 16)
    model = nn.Sequential(ColumnParallelLinear.from_dense(first, gather_output=False),
                          nn.GELU(), RowParallelLinear.from_dense(second,
                                                                  input_is_parallel=True))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.manual_seed(0)  # the same input on every rank, as tensor parallelism needs
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    return {"model, optimizer": _fields(model_state_bytes(model, opt))}


def _pp(rank, world_size):
    from engine.pp.partition import split_model

    stage = split_model(MLP(SIZES, seed=0).net, [0, 2])[rank]  # Linear+GELU | Linear
    opt = torch.optim.Adam(stage.parameters(), lr=1e-3)
    stage(torch.randn(4, stage[0].in_features)).sum().backward()  # this stage's own backward
    opt.step()
    return {"stage, optimizer": _fields(model_state_bytes(stage, opt))}


# -- what each should hold, from the shapes and the formula -----------------------------------

def _expected(params, grads, optimizer, buffers=0, offloaded=0) -> dict:
    return {"params": params, "grads": grads, "optimizer": optimizer,
            "total": params + grads + optimizer + buffers, "buffers": buffers,
            "offloaded": offloaded}


def _zero_formula(stage, dtype, steps):
    """ZeRO paper, section 5.1: fp32 Adam is 4 + 4 + 8 bytes per parameter; bf16 mixed
    precision 2 + 2 + 12 (the fp32 master is part of the optimizer's 12)."""
    sizes = dict(param_bytes=4, grad_bytes=4, k=8) if dtype == torch.float32 else {}
    f = theory.zero_model_state_bytes(PSI, N, stage, **sizes)
    return _expected(f["params"], f["grads"], f["optimizer"] + STEP * steps)


def _offload_formula(stage):
    """ZeRO-Offload: the fp32 master (4 bytes) and Adam's moments (8) move to the host."""
    on_device = theory.zero_model_state_bytes(PSI, N, stage, param_bytes=4, grad_bytes=4, k=0)
    host = theory.zero_model_state_bytes(PSI, N, stage, k=12)["optimizer"] + STEP
    return _expected(on_device["params"], on_device["grads"], 0, offloaded=host)


# column-parallel: 1/N of the rows and bias; row-parallel: 1/N of the columns, the bias whole
TP_ELEMENTS = (32 * 16 + 32) // N + (16 * 32) // N + 16

CASES = {
    "plain Adam": (_plain, (), _expected(4 * PSI, 4 * PSI, 8 * PSI + STEP * TENSORS)),
    "NaiveDataParallel": (_naive_dp, (), _expected(4 * PSI, 4 * PSI, 8 * PSI + STEP * TENSORS)),
    # DDP's bucket holds a second copy of the gradients (what gradient_as_bucket_view saves)
    "DataParallel": (_dp, (), _expected(4 * PSI, 4 * PSI, 8 * PSI + STEP * TENSORS,
                                        buffers=4 * PSI)),
    **{f"ZeroOptimizer stage {s}": (_zero, (s, False, torch.float32),
                                    _zero_formula(s, torch.float32, 1)) for s in (0, 1, 2)},
    "ZeroOptimizer stage 2 bf16": (_zero, (2, False, torch.bfloat16),
                                   _zero_formula(2, torch.bfloat16, 1)),
    **{f"ZeroOptimizer stage {s} offload": (_zero, (s, True, torch.float32),
                                            _offload_formula(s)) for s in (0, 1, 2)},
    # the tuned one's stage-1 reduce-scatter also keeps the ring's scratch: two chunks (1/N
    # each) of the one bucket; stage 2 reduce-scatters in backward (built-in), and the ring's
    # all-gather receives in place
    "TunedZeroOptimizer stage 1": (_zero, (1, False, torch.float32, TunedZeroOptimizer),
                                   _expected(4 * PSI, 4 * PSI, 8 * PSI // N + STEP,
                                             buffers=2 * 4 * PSI // N)),
    "TunedZeroOptimizer stage 2": (_zero, (2, False, torch.float32, TunedZeroOptimizer),
                                   _zero_formula(2, torch.float32, 1)),
    "ZeroDataParallel": (_zero3, (torch.float32,), _zero_formula(3, torch.float32, 2)),
    "ZeroDataParallel bf16": (_zero3, (torch.bfloat16,), _zero_formula(3, torch.bfloat16, 2)),
    "tensor parallel": (_tp, (), _expected(4 * TP_ELEMENTS, 4 * TP_ELEMENTS,
                                           8 * TP_ELEMENTS + STEP * TENSORS)),
}


def test_the_shapes_leave_no_padding():
    assert [sum(p.numel() for p in layer.parameters())
            for layer in MLP(SIZES).net if isinstance(layer, nn.Linear)] == LAYERS
    assert all(n % N == 0 for n in LAYERS)


@pytest.mark.parametrize("name", list(CASES))
def test_every_strategy_reports_what_it_holds(name):
    fn, args, expected = CASES[name]
    for rank, ways in enumerate(run_ranks(fn, N, *args)):
        for way, got in ways.items():
            assert got == expected, f"{name}, rank {rank}, model_state_bytes({way})"


def test_pipeline_stages_each_report_their_own_layers():
    for rank, ways in enumerate(run_ranks(_pp, N)):
        n = LAYERS[rank]
        assert ways["stage, optimizer"] == _expected(4 * n, 4 * n, 8 * n + STEP * 2)


def _torch_zero(rank, world_size):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = MLP(SIZES, seed=0)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    _one_step(model, opt, rank)
    return _fields(model_state_bytes(model, opt))


def test_pytorchs_zero_redundancy_optimizer_shards_adam_over_the_ranks():
    # it keeps whole tensors' state on one rank each: the ranks' shares add up to plain Adam
    held = run_ranks(_torch_zero, N)
    assert all(h["optimizer"] > 0 for h in held)
    assert sum(h["optimizer"] for h in held) == 8 * PSI + STEP * TENSORS
    assert all(h["params"] == h["grads"] == 4 * PSI for h in held)


@pytest.mark.parametrize("holders, named", [
    ((object(),), "object"),
    ((MLP(SIZES), "adam"), "str"),
    ((MLP(SIZES), {"exp_avg": torch.zeros(3)}), "dict"),
])
def test_what_cannot_be_counted_is_a_type_error_not_a_zero(holders, named):
    with pytest.raises(TypeError, match=f"cannot count a {named}"):
        model_state_bytes(*holders)


def _torch_ddp(rank, world_size):
    model = nn.parallel.DistributedDataParallel(MLP(SIZES))
    try:
        model_state_bytes(model)
    except TypeError as e:
        return str(e)
    return None


def test_pytorchs_ddp_is_refused_its_buckets_are_out_of_sight():
    for message in run_ranks(_torch_ddp, N):
        assert message is not None and "DistributedDataParallel" in message
        assert "model_state_bytes(ddp.module)" in message


# -- what a compressor keeps between steps is held memory too ---------------------------------

def _compressed(rank, world_size, which):
    from engine.compress import FP16, PowerSGD, TopK

    compressor = {"fp16": FP16(), "topk": TopK(0.1),
                  "powersgd": PowerSGD(1, start_iter=0)}[which]
    model = DataParallel(MLP(SIZES, seed=0), bucket_cap_mb=1, compressor=compressor)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    _one_step(model, opt, rank)
    return _fields(model_state_bytes(model, opt))


def test_data_parallel_counts_what_its_compressor_keeps():
    dense = 4 * PSI
    # one bucket of PSI fp32 gradients; written from the algorithms, not read back:
    # FP16 keeps nothing; Top-K a residual and its last selection, each bucket-sized;
    # PowerSGD (rank 1) an error-feedback bucket and P (n x 1), Q (m x 1) per weight matrix
    # (biases are vectors: all-reduced as they are, nothing kept)
    kept = {"fp16": 0, "topk": 2 * dense, "powersgd": dense + 4 * (32 + 16) + 4 * (8 + 32)}
    for which, extra in kept.items():
        for held in run_ranks(_compressed, N, which):
            assert held["buffers"] == dense + extra, which  # bucket buffer + compressor state
            assert held["total"] == 3 * dense + extra, which


class _Stateful:
    """A compressor object that keeps something and cannot say what."""

    def __init__(self):
        self.memory = {}

    def __call__(self, bucket, group=None):
        from engine.comm import ops
        from engine.compress.base import Then

        self.memory[bucket.index] = bucket.buffer.clone()
        return Then(ops.all_reduce(bucket.buffer, group=group, async_op=True),
                    lambda: bucket.buffer.div_(2))


def _unknown_compressor(rank, world_size):
    model = DataParallel(MLP(SIZES, seed=0), compressor=_Stateful())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    _one_step(model, opt, rank)
    model_state_bytes(model, opt)


def test_a_compressor_that_cannot_say_what_it_keeps_is_refused_not_counted_as_zero():
    from engine import RankError

    with pytest.raises(RankError, match="cannot count what the compressor .*_Stateful"):
        run_ranks(_unknown_compressor, N)
