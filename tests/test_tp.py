"""engine.tp: every tensor-parallel piece equals its dense original (outputs and gradients),
a layer costs exactly 2 + 2 all-reduces of b*s*h elements, and bad sizes are clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import theory
from engine.comm import ops
from engine.observe.meter import CommMeter
from engine.compose.model import GPT, ModelConfig
from engine.compose.parallelize import parallelize
from engine.compose.plan import Plan
from engine.compose.state import dense_state, join_tp
from engine.model.gpt import TinyGPT
from engine.model.data import token_data
from engine.moe.layer import single_rank_group
from engine.tp import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                       copy_to_tp, gather_from_tp, reduce_from_tp, vocab_parallel_cross_entropy)
from tests.helpers import BEYOND_CPU, DEVICE_WORLD_SIZES, rank_device, run_ranks

CFG = {1: ModelConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32),
       2: ModelConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32),
       3: ModelConfig(vocab=63, seq_len=16, layers=2, heads=3, hidden=48),
       4: ModelConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32)}
# what tensor parallelism splits beside GPT-2's shape: grouped-query attention, untied
# embeddings, q, k, v without bias, an MLP not 4 hidden wide; and a mixture of experts (its
# experts whole on every tensor-parallel rank, only attention split)
CHOICES = {"gqa untied no-bias ffn24": ModelConfig(vocab=64, seq_len=16, layers=2, heads=4,
                                                   hidden=32, kv_heads=2, tied=False,
                                                   qkv_bias=False, ffn_hidden=24),
           "moe": ModelConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32,
                              num_experts=4, capacity_factor=2.0)}


def tensor_parallel(cfg: ModelConfig, t: int, sequence_parallel: bool = False, device="cpu",
                    **optimizer):
    """The one GPT of ``cfg`` split ``t`` ways by the composed engine (``parallelize``), every
    expert on every rank; ``optimizer``: momentum SGD's arguments (default: lr 0.5)."""
    plan = Plan(tp=t, sequence_parallel=sequence_parallel)
    model = GPT(cfg, seed=0, expert_group=single_rank_group() if cfg.num_experts else None)
    return parallelize(model.to(device), plan.mesh(), plan, torch.optim.SGD,
                       **({"lr": 0.5, "momentum": 0.9} | optimizer))


def tp_loss(par, x, y):
    """The mean vocab-parallel cross-entropy of the split model's logits, plus an MoE model's
    router losses (as :meth:`engine.model.gpt.GPT.loss`)."""
    logits = par.module(x)
    return vocab_parallel_cross_entropy(logits, y, par.tp_group).mean() + \
        par.model.router_losses()


def dense_grads(par) -> dict[str, torch.Tensor]:
    """Every gradient of a split model, whole, named as the dense model names it."""
    return {n: join_tp(n, p.grad, par) for n, p in par.model.named_parameters()}


def _mappings(rank, world_size):
    x = torch.full((3,), float(rank + 1), requires_grad=True)
    copy_to_tp(x).sum().backward()  # f: identity forward, sum of gradients backward
    y = torch.full((3,), float(rank + 1), requires_grad=True)
    out = reduce_from_tp(y)  # g: sum forward, identity backward
    out.sum().backward()
    return x.grad.tolist(), out.tolist(), y.grad.tolist()


def test_f_and_g_are_conjugate():
    for f_grad, g_out, g_grad in run_ranks(_mappings, 3):
        assert f_grad == [3.0] * 3  # three ranks' gradients of 1 each
        assert g_out == [6.0] * 3  # 1 + 2 + 3
        assert g_grad == [1.0] * 3


def _linear_pair(rank, world_size, gather_output, input_is_parallel):
    torch.manual_seed(0)
    a, b = nn.Linear(12, 24), nn.Linear(24, 12)
    x = torch.randn(5, 12, requires_grad=True)
    dense = b(F.gelu(a(x)))
    dense.square().sum().backward()
    dense_x_grad = x.grad.clone()
    x.grad = None
    col = ColumnParallelLinear.from_dense(a, gather_output=gather_output)
    row = RowParallelLinear.from_dense(b, input_is_parallel=input_is_parallel)
    with CommMeter() as forward:
        out = row(F.gelu(col(x)))
    with CommMeter() as backward:
        out.square().sum().backward()
    t = world_size
    grads_match = all([
        torch.allclose(col.weight.grad, a.weight.grad.chunk(t, 0)[rank], atol=1e-5),
        torch.allclose(col.bias.grad, a.bias.grad.chunk(t, 0)[rank], atol=1e-5),
        torch.allclose(row.weight.grad, b.weight.grad.chunk(t, 1)[rank], atol=1e-5),
        torch.allclose(row.bias.grad, b.bias.grad, atol=1e-5),
        torch.allclose(x.grad, dense_x_grad, atol=1e-5)])
    ops = [e.op for e in forward.events], [e.op for e in backward.events]
    return (out - dense).abs().max().item(), grads_match, ops


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_column_then_row_equals_the_dense_mlp_with_one_all_reduce_each_way(world_size):
    for worst, grads_match, (fwd, bwd) in run_ranks(_linear_pair, world_size, False, True):
        assert worst <= 1e-5 and grads_match
        if world_size > 1:
            assert fwd == ["all_reduce"] and bwd == ["all_reduce"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_gathered_column_output_and_scattered_row_input_also_match(world_size):
    for worst, grads_match, (fwd, _) in run_ranks(_linear_pair, world_size, True, False):
        assert worst <= 1e-5 and grads_match
        assert fwd == ["all_gather", "all_reduce"]


def _vocab(rank, world_size):
    torch.manual_seed(0)
    emb = nn.Embedding(12, 6)
    ids = torch.randint(12, (4, 5))
    logits = torch.randn(4, 5, 12, requires_grad=True)
    targets = torch.randint(12, (4, 5))
    dense_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    dense_loss.backward()
    local = logits.detach().chunk(world_size, -1)[rank].clone().requires_grad_()
    with CommMeter() as meter:
        loss = vocab_parallel_cross_entropy(local, targets).mean()
    loss.backward()
    tp_emb = VocabParallelEmbedding.from_dense(emb)
    return ((loss - dense_loss).abs().item(),
            torch.allclose(local.grad, logits.grad.chunk(world_size, -1)[rank], atol=1e-6),
            torch.allclose(tp_emb(ids), emb(ids)),
            max((e.payload_bytes for e in meter.events), default=0))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_vocab_parallel_embedding_and_loss_match_dense_without_gathering_logits(world_size):
    for loss_diff, grad_ok, emb_ok, largest in run_ranks(_vocab, world_size):
        assert loss_diff <= 1e-6 and grad_ok and emb_ok
        assert largest <= 4 * 5 * 4  # one number per token, never the 12-wide logits


def _gpt(rank, world_size, steps, device="cpu", choice=None):
    on = rank_device(device)
    cfg = CFG[world_size] if choice is None else CHOICES[choice]
    alone = single_rank_group() if cfg.num_experts else None  # every expert on this rank
    dense = GPT(cfg, seed=0, expert_group=alone).to(on)
    par = tensor_parallel(cfg, world_size, device=on)
    x, y = (t.to(on) for t in token_data(3, cfg.seq_len, cfg.vocab, seed=1))
    logits_diff = (gather_from_tp(par.module(x), par.tp_group) - dense(x)).abs().max().item()
    loss_diff = (tp_loss(par, x, y) - dense.loss(x, y)).abs().item()
    tp_loss(par, x, y).backward()
    dense.loss(x, y).backward()
    grads = dense_grads(par)
    grad_diff = max((grads[n] - p.grad).abs().max().item()
                    for n, p in dense.named_parameters())
    # momentum SGD, not Adam: the key bias's gradient is exactly zero in theory (softmax
    # ignores a shift shared by all keys), so both models hold only round-off there (~1e-9),
    # and Adam would scale that noise up to +-lr steps in different directions
    opt = torch.optim.SGD(dense.parameters(), lr=0.5, momentum=0.9)
    for _ in range(steps):
        for loss_of, optimizer in ((dense.loss, opt), (lambda a, b: tp_loss(par, a, b),
                                                       par.optimizer)):
            optimizer.zero_grad()
            loss_of(x, y).backward()
            optimizer.step()
    params = dense_state(par)
    param_diff = max((params[n] - p).abs().max().item() for n, p in dense.named_parameters())
    return logits_diff, loss_diff, grad_diff, param_diff


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_tiny_gpt_logits_loss_gradients_and_training_match_dense(world_size):
    for logits_diff, loss_diff, grad_diff, param_diff in run_ranks(_gpt, world_size, 3):
        assert logits_diff <= 1e-5 and loss_diff <= 1e-5
        assert grad_diff <= 1e-5  # every gradient, gathered into the dense layout
        assert param_diff <= 1e-5  # after 3 training steps


@pytest.mark.parametrize("choice", sorted(CHOICES))
def test_grouped_query_untied_bias_free_and_moe_models_split_and_match_dense(choice):
    for diffs in run_ranks(_gpt, 2, 3, "cpu", choice):
        assert max(diffs) <= 1e-5, diffs


@pytest.mark.parametrize("device", BEYOND_CPU)
@pytest.mark.parametrize("world_size", DEVICE_WORLD_SIZES)
def test_tiny_gpt_matches_dense_on_each_device(device, world_size):
    for logits_diff, loss_diff, grad_diff, param_diff in run_ranks(_gpt, world_size, 3, device,
                                                                   device=device):
        assert max(logits_diff, loss_diff, grad_diff, param_diff) <= 1e-5


def _count(rank, world_size, layers, b):
    cfg = ModelConfig(vocab=64, seq_len=16, layers=layers, heads=4, hidden=32)
    par = tensor_parallel(cfg, world_size)
    tp = tuple(ops.group_ranks(par.tp_group))  # (the data-parallel wrapper's group: one rank)
    x, y = token_data(b, 16, 64, seed=1)
    with CommMeter() as forward:
        loss = tp_loss(par, x, y)
    with CommMeter() as backward:
        loss.backward()
    fwd, bwd = ([e for e in m.events if tuple(e.group) == tp] for m in (forward, backward))
    big = [e for e in fwd + bwd if e.payload_bytes == b * 16 * 32 * 4]
    return (sum(e.op == "all_reduce" for e in fwd), sum(e.op == "all_reduce" for e in bwd),
            sum(e.bytes_sent for e in big))


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_layer_costs_two_all_reduces_forward_and_two_backward(world_size):
    b = 3
    one = run_ranks(_count, world_size, 1, b)[0]
    three = run_ranks(_count, world_size, 3, b)[0]
    assert (three[0] - one[0]) / 2 == 2  # forward, per layer
    assert (three[1] - one[1]) / 2 == 2  # backward, per layer
    per_layer = (three[2] - one[2]) / 2 / 4  # bytes -> fp32 elements
    assert per_layer == theory.tp_comm_elements_per_layer(b, 16, 32, world_size)


def _against_dtensor(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(4, 8)
    ours = nn.Sequential(ColumnParallelLinear.from_dense(dense[0], gather_output=False),
                         nn.GELU(), RowParallelLinear.from_dense(dense[2],
                                                                 input_is_parallel=True))
    mesh = init_device_mesh("cpu", (world_size,))
    theirs = parallelize_module(dense, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    out_ours, out_theirs = ours(x), theirs(x)
    out_ours.sum().backward()
    out_theirs.sum().backward()
    return ((out_ours - out_theirs).abs().max().item(),
            (ours[0].weight.grad - theirs[0].weight.grad.to_local()).abs().max().item(),
            (ours[2].weight.grad - theirs[2].weight.grad.to_local()).abs().max().item())


def test_matches_pytorch_dtensor_colwise_and_rowwise_parallel():
    for diffs in run_ranks(_against_dtensor, 2):
        assert max(diffs) <= 1e-6


@pytest.mark.parametrize("cfg, t, message", [
    (ModelConfig(vocab=64, heads=4, hidden=32), 3, r"tp = 3 must divide heads = 4"),
    (ModelConfig(vocab=64, heads=2, hidden=32), 4, r"tp = 4 must divide heads = 2"),
    (ModelConfig(vocab=63, heads=4, hidden=32), 2, r"tp = 2 must divide vocab = 63"),
    (ModelConfig(heads=4, hidden=32, ffn_hidden=50), 4, r"tp = 4 must divide ffn_hidden = 50"),
    (ModelConfig(heads=4, hidden=32, kv_heads=2), 4, r"tp = 4 must divide KV heads = 2"),
])
def test_sizes_that_do_not_split_are_clear_errors_before_any_rank_starts(cfg, t, message):
    with pytest.raises(ValueError, match=message):
        Plan(tp=t).check(cfg, rows=1)
    with pytest.raises(ValueError, match="tp must be a positive int, got 0"):
        Plan(tp=0)


def test_a_layer_that_does_not_split_is_a_clear_error_on_the_ranks():
    def build(rank, world_size):
        ColumnParallelLinear.from_dense(nn.Linear(4, 10))

    with pytest.raises(Exception, match="out_features=10 is not divisible by the "
                                        "tensor-parallel degree 4"):
        run_ranks(build, 4)


@pytest.mark.parametrize("world_size", [2, 4])
def test_tp_traffic_grows_with_tokens_and_zero3_traffic_with_parameters(world_size):
    from engine.labs.tp_zero3 import layer_traffic

    t, h = world_size, 32
    layer_params = 12 * h * h + 13 * h  # qkv, proj, fc, out weights and biases; two LayerNorms
    for batch, seq in ((1, 8), (16, 16)):
        measured = run_ranks(layer_traffic, world_size, batch, seq)[0]
        assert measured["tp"] == theory.tp_comm_elements_per_layer(batch, seq, h, t)
        assert measured["zero3"] == pytest.approx(3 * (t - 1) / t * layer_params, rel=0.01)
    assert 8 * theory.tp_zero3_crossover_tokens(h) * h == pytest.approx(3 * layer_params)


def _cut_as_the_table_says(rank, world_size):
    """Every parameter of a tensor-parallel GPT is the dense one cut as engine.tp.layout says."""
    from engine.tp.layout import HEADS, heads_slice, qkv_sizes, split_dim

    cfg = CFG[world_size]
    whole = dict(GPT(cfg, seed=0).named_parameters())
    mine = dict(tensor_parallel(cfg, world_size).model.named_parameters())
    wrong = []
    for name, local in mine.items():
        split = split_dim(name)
        if split is None:
            expected = whole[name]
        elif split == HEADS:
            expected = heads_slice(whole[name], world_size, rank,
                                   qkv_sizes(cfg.heads, cfg.kv_heads_or_heads, cfg.head_dim))
        else:
            expected = whole[name].chunk(world_size, dim=split)[rank]
        if not torch.equal(local, expected):
            wrong.append(name)
    return sorted(mine), wrong


@pytest.mark.parametrize("world_size", [2, 3])
def test_one_layout_table_says_how_every_parameter_is_cut(world_size):
    dense_names = sorted(n for n, _ in TinyGPT(CFG[world_size]).named_parameters())
    for names, wrong in run_ranks(_cut_as_the_table_says, world_size):
        assert names == dense_names  # the table's names are the dense model's
        assert wrong == []


def test_join_puts_back_together_what_the_table_cuts():
    from engine.tp.layout import HALVES, HEADS, TP_SPLIT, halves, heads_slice, join, split_dim

    g = torch.Generator().manual_seed(0)
    for t in (1, 2, 3):
        for name, split in TP_SPLIT.items():
            whole = torch.randn(6 * t, 3 * t, generator=g)
            if split == HEADS:
                slices = [heads_slice(whole, t, r) for r in range(t)]
            elif split == HALVES:  # rank r: [gate_r | up_r], its rows of each half
                slices = [heads_slice(whole, t, r, halves(6 * t)) for r in range(t)]
            else:
                slices = list(whole.chunk(t, dim=split))
            assert torch.equal(join(f"blocks.1.{name}", slices), whole), (name, t)
    assert split_dim("blocks.0.ln1.weight") is None and split_dim("attn.proj.bias") is None
    gate_up = torch.arange(8.0).unsqueeze(1)  # gate rows 0-3, up rows 4-7
    mine = heads_slice(gate_up, 2, 1, halves(8))
    assert mine.flatten().tolist() == [2.0, 3.0, 6.0, 7.0]  # rank 1: its gate rows, its up rows
    assert join("pos.weight", [torch.ones(2), torch.ones(2)]).shape == (2,)  # replicated


def test_the_composed_engine_reads_the_same_table_and_grouped_query_heads_join_back():
    from engine.compose import state
    from engine.tp import layout
    from engine.tp.layout import heads_slice, join, qkv_sizes

    assert state.split_dim is layout.split_dim and state.heads_joined is layout.heads_joined
    sizes = qkv_sizes(heads=4, kv_heads=2, head_dim=3)  # q 12 rows, k 6, v 6
    whole = torch.arange(24.0).unsqueeze(1).repeat(1, 5)
    slices = [heads_slice(whole, 2, r, sizes) for r in range(2)]
    rows = [0, 1, 2, 3, 4, 5, 12, 13, 14, 18, 19, 20]  # rank 0: query heads 0-1, kv head 0
    assert torch.equal(slices[0][:, 0], torch.tensor(rows, dtype=torch.float32))
    assert torch.equal(join("blocks.0.attn.qkv.weight", slices, sizes), whole)
