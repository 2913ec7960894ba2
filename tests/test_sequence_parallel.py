"""Megatron sequence parallelism (engine.tp's layers with ``sequence_parallel=True``, applied to
the one GPT by ``parallelize`` with ``Plan(tp=t, sequence_parallel=True)``): the same model as
plain tensor parallelism, the same forward traffic, and the activation saving of Korthikanti et
al.

Tolerances: fp32, ``1e-5`` for logits, loss, gradients and parameters after 3 SGD steps (the
tensor-parallel tests' own), against plain TP and against the dense model.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from engine import RankError, theory
from engine.comm import ops
from engine.compose.model import GPT, ModelConfig
from engine.compose.parallelize import parallelize
from engine.compose.plan import Plan
from engine.compose.state import dense_state, join_tp
from engine.observe.meter import CommMeter
from engine.observe.memory import ActivationTracker
from engine.model.data import token_data
from engine.tp import (ColumnParallelLinear, RowParallelLinear, gather_from_tp,
                       scatter_to_sequence_parallel, vocab_parallel_cross_entropy)
from engine.tp.mappings import check_sequence_split
from tests.helpers import run_ranks

SEQ = 12  # splits 2, 3 and 4 ways
CFG = {2: ModelConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32),
       3: ModelConfig(vocab=63, seq_len=16, layers=2, heads=3, hidden=48),
       4: ModelConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32)}


def split(cfg: ModelConfig, t: int, sp: bool, mesh=None):
    """The one GPT of ``cfg`` split ``t`` ways by ``parallelize``, with or without sequence
    parallelism, stepped by momentum SGD."""
    plan = Plan(tp=t, sequence_parallel=sp)
    return parallelize(GPT(cfg, seed=0), mesh or plan.mesh(), plan, torch.optim.SGD, lr=0.5,
                       momentum=0.9)


def loss_of(par, x, y):
    return vocab_parallel_cross_entropy(par.module(x), y, par.tp_group).mean()


def _train(rank, t, steps):
    cfg = CFG[t]
    dense = GPT(cfg, seed=0)
    tp = split(cfg, t, False)
    tp_sp = split(cfg, t, True, tp.mesh)
    x, y = token_data(3, SEQ, cfg.vocab, seed=1)
    logits = [dense(x)] + [gather_from_tp(par.module(x), par.tp_group) for par in (tp, tp_sp)]
    dense.loss(x, y).backward()
    for par in (tp, tp_sp):
        loss_of(par, x, y).backward()
    grads = [dict((n, p.grad) for n, p in dense.named_parameters())] + \
        [{n: join_tp(n, p.grad, par) for n, p in par.model.named_parameters()}
         for par in (tp, tp_sp)]
    steppers = [(dense.loss, torch.optim.SGD(dense.parameters(), lr=0.5, momentum=0.9))] + \
        [(lambda a, b, par=par: loss_of(par, a, b), par.optimizer) for par in (tp, tp_sp)]
    for _ in range(steps):
        for loss, opt in steppers:
            opt.zero_grad()
            loss(x, y).backward()
            opt.step()
    params = [dict(dense.named_parameters()), dense_state(tp), dense_state(tp_sp)]

    def worst(a, b):  # over every parameter of the dense model (head.weight is tok.weight)
        return max((a[n] - b[n]).abs().max().item() for n in params[0])

    return {"logits": ((logits[2] - logits[1]).abs().max().item(),
                       (logits[2] - logits[0]).abs().max().item()),
            "grads": (worst(grads[2], grads[1]), worst(grads[2], grads[0])),
            "params": (worst(params[2], params[1]), worst(params[2], params[0]))}


@pytest.mark.parametrize("t", [2, 3, 4])
def test_sequence_parallel_gpt_equals_plain_tensor_parallel_and_dense(t):
    for found in run_ranks(_train, t, 3):
        for what, (against_tp, against_dense) in found.items():
            assert against_tp <= 1e-5 and against_dense <= 1e-5, (what, found)


def _measure(rank, t, layers, b=2, h=32):
    """Activation bytes and the bytes and operations on the tensor-parallel group (the
    data-parallel wrapper ``parallelize`` adds is over one rank here: it sends nothing)."""
    cfg = ModelConfig(vocab=64, seq_len=16, layers=layers, heads=4, hidden=h)
    x, y = token_data(b, SEQ, cfg.vocab, seed=1)
    found, mesh = {}, Plan(tp=t).mesh()
    for sp in (False, True):
        par = split(cfg, t, sp, mesh)
        tp = tuple(ops.group_ranks(par.tp_group))
        with CommMeter(count="wire") as fwd, \
                ActivationTracker(exclude=par.model.parameters()) as acts:
            loss = loss_of(par, x, y)
        with CommMeter(count="wire") as bwd:
            loss.backward()
        assert fwd.all_counted and bwd.all_counted
        on_tp = [[e for e in m.events if tuple(e.group) == tp] for m in (fwd, bwd)]
        found[sp] = (acts.bytes, *(sum(e.bytes_sent for e in events) for events in on_tp),
                     *([e.op for e in events] for events in on_tp))
    return found


@functools.lru_cache(maxsize=None)
def _one_and_three_layers(t):
    """What a 1-layer and a 3-layer model measure (their difference / 2: one layer's worth);
    launched once for both tests below."""
    return run_ranks(_measure, t, 1)[0], run_ranks(_measure, t, 3)[0]


def _per_layer(one, three, sp, i):
    return (three[sp][i] - one[sp][i]) / 2


@pytest.mark.parametrize("t", [2, 4])
def test_traffic_per_layer_forward_equals_tp_and_backward_adds_the_regather(t):
    b, s, h = 2, SEQ, 32
    one, three = _one_and_three_layers(t)
    tp_fwd, tp_bwd = _per_layer(one, three, False, 1), _per_layer(one, three, False, 2)
    sp_fwd, sp_bwd = _per_layer(one, three, True, 1), _per_layer(one, three, True, 2)
    assert (tp_fwd + tp_bwd) / 4 == theory.tp_comm_elements_per_layer(b, s, h, t)
    assert sp_fwd == tp_fwd  # each all-reduce is now a reduce-scatter plus an all-gather
    # the six h-element gradient all-reduces of the LayerNorms and row-parallel biases
    param_grads = 6 * 2 * (t - 1) / t * h
    assert (sp_fwd + sp_bwd) / 4 == theory.sp_comm_elements_per_layer(b, s, h, t) + param_grads
    ops_fwd = [op for op in three[True][3] if op != "all_reduce"]
    ops_one = [op for op in one[True][3] if op != "all_reduce"]
    assert (ops_fwd.count("all_gather") - ops_one.count("all_gather")) / 2 == 2
    assert (ops_fwd.count("reduce_scatter") - ops_one.count("reduce_scatter")) / 2 == 2
    assert "all_reduce" not in one[True][3][:-3]  # only the vocab-parallel loss all-reduces


@pytest.mark.parametrize("t", [2, 4])
def test_activation_saving_is_the_replicated_term_divided_by_t(t):
    b, s, h = 2, SEQ, 32
    one, three = _one_and_three_layers(t)
    tp, sp = _per_layer(one, three, False, 0), _per_layer(one, three, True, 0)
    # Korthikanti et al.'s replicated 10sbh (16-bit, with two dropout masks) is, in this fp32
    # model without dropout, the inputs of two LayerNorms and of two first linears (4 sbh
    # values of 4 bytes) and each LayerNorm's mean and 1/std (2 x 2 sb values)
    replicated = 4 * (4 * s * b * h + 4 * s * b)
    assert tp - sp == replicated * (1 - 1 / t)


def test_sequence_that_does_not_split_is_a_clear_error():
    with pytest.raises(ValueError, match="length 10 is not divisible by the tensor-parallel "
                                         "degree 4"):
        check_sequence_split(10, 4)

    def uneven(rank, world_size):
        par = split(ModelConfig(vocab=64, seq_len=16, heads=4, hidden=32), 4, True)
        par.module(token_data(1, 10, 64)[0])

    with pytest.raises(RankError, match="length 10 is not divisible by the tensor-parallel "
                                        "degree 4"):
        run_ranks(uneven, 4)


def test_layers_refuse_sequence_parallel_without_their_partner():
    def build(rank, world_size):
        with pytest.raises(ValueError, match="pass gather_output=False"):
            ColumnParallelLinear.from_dense(nn.Linear(4, 8), sequence_parallel=True)
        with pytest.raises(ValueError, match="pass input_is_parallel=True"):
            RowParallelLinear.from_dense(nn.Linear(8, 4), sequence_parallel=True)
        x = torch.arange(8.0).view(4, 2).requires_grad_()
        part = scatter_to_sequence_parallel(x, dim=0)
        (part * (rank + 1)).sum().backward()
        return part.tolist(), x.grad.tolist()

    (p0, g0), (p1, g1) = run_ranks(build, 2)
    assert p0 == [[0, 1], [2, 3]] and p1 == [[4, 5], [6, 7]]
    assert g0 == g1 == [[1, 1], [1, 1], [2, 2], [2, 2]]  # gradients all-gathered
