"""The composed engine's parts: one GPT (TinyGPT bit for bit by default), the plan's checks,
the layout-independent data, and the global-token loss (the naive per-micro-batch mean
measured against it)."""

from __future__ import annotations

import pytest
import torch

from engine.model.data import global_batch
from engine.compose.data import rank_slice
from engine.compose.loss import masked_sum
from engine.compose.model import GPT, ModelConfig
from engine.compose.plan import Plan
from engine.model.gpt import GPTConfig, TinyGPT
from tests.helpers import run_ranks

CFG = ModelConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32, kv_heads=2,
                  qkv_bias=False)


def test_the_default_gpt_is_tinygpt_bit_for_bit():
    cfg = GPTConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32)
    tiny, ours = TinyGPT(cfg, seed=3), GPT(ModelConfig.from_gpt(cfg), seed=3)
    assert list(tiny.state_dict()) == list(ours.state_dict())
    for name, value in tiny.state_dict().items():
        assert torch.equal(value, ours.state_dict()[name]), name
    idx = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(tiny(idx), ours(idx))


def test_gqa_untied_and_moe_variants_build_and_run():
    idx = torch.randint(64, (2, 16))
    for cfg in (ModelConfig(kv_heads=1), ModelConfig(tied=False), ModelConfig(num_experts=4)):
        model = GPT(cfg)
        assert model(idx).shape == (2, 16, 64)
        assert (model.head.weight is model.tok.weight) == cfg.tied
    assert GPT(ModelConfig(kv_heads=2)).blocks[0].attn.qkv.out_features == (4 + 2 * 2) * 8
    moe = GPT(ModelConfig(num_experts=4))
    assert float(moe.router_losses()) == 0.0  # before a forward
    moe(idx)
    assert float(moe.router_losses().detach()) > 0


@pytest.mark.parametrize("plan, cfg, message", [
    (Plan(tp=8), CFG, r"tp = 8 must divide heads = 4"),
    (Plan(tp=4), CFG, r"tp = 4 must divide KV heads = 2"),
    (Plan(cp=2, cp_method="ulysses", tp=2), CFG,
     r"cp \(Ulysses gives each rank whole heads\) = 2 must divide KV heads per "
     r"tensor-parallel rank = 1"),
    (Plan(cp=16), CFG, r"cp = 16 with ring-zigzag cuts the sequence into 32 equal chunks: 32 "
                       r"must divide seq_len = 16"),
    (Plan(dp=2, ep=2), CFG, r"ep = 2 spreads experts, but the model is dense"),
    (Plan(dp=3, ep=3), ModelConfig(num_experts=4), r"ep = 3 must divide num_experts = 4"),
    (Plan(pp=4, micro_batches=4), CFG,
     r"pp = 4 pipeline stages need at least 4 layers, the model has 2"),
    (Plan(pp=2, schedule="zb_h1"), CFG, r"schedule 'zb_h1' on pp = 2 stages needs at least 2 "
                                        r"micro-batches .* got micro_batches = 1"),
    (Plan(dp=2, micro_batches=3), CFG, r"dp x micro_batches = 6 must divide rows = 4"),
])
def test_the_plan_refuses_what_the_model_cannot_carry(plan, cfg, message):
    with pytest.raises(ValueError, match=message):
        plan.check(cfg, rows=4)


def test_the_plan_refuses_bad_degrees_before_any_rank_starts():
    with pytest.raises(ValueError, match=r"ep = 3 must divide dp x cp = 2 x 2 = 4"):
        Plan(dp=2, cp=2, ep=3)
    with pytest.raises(ValueError, match="sequence_parallel=True .* needs tp > 1"):
        Plan(sequence_parallel=True)
    with pytest.raises(ValueError, match="cp_method must be one of"):
        Plan(cp=2, cp_method="ring")
    with pytest.raises(ValueError, match=r"compress='fp16' .* needs zero = 0 \(ZeRO-1 to 3 "
                                         r"reduce-scatter\), got zero = 1"):
        Plan(dp=2, zero=1, compress="fp16")
    Plan(dp=2, pp=2, ep=2, compress="bf16")  # the step's all-reduce; the dense part under ep


@pytest.mark.parametrize("plan, message", [
    (Plan(pp=2, schedule="dualpipe_v", micro_batches=2),
     r"schedule 'dualpipe_v' on pp = 2 with micro_batches = 2: DualPipeV needs m "
     r"\(micro-batches\) >= 2p = 4"),
    (Plan(pp=2, schedule="interleaved", micro_batches=3),
     r"schedule 'interleaved' on pp = 2 with micro_batches = 3: .*multiple"),
])
def test_the_plan_refuses_what_a_schedule_rejects_before_any_rank_starts(plan, message):
    cfg = ModelConfig(layers=4)
    with pytest.raises(ValueError, match=message):
        plan.check(cfg, rows=4)


def test_every_layout_sees_the_same_tokens():
    batch = global_batch(3, rows=4, seq_len=16, vocab=64, seed=1, varlen=True)
    for dp, cp, layout in ((2, 1, "zigzag"), (2, 2, "zigzag"), (1, 4, "contiguous")):
        seen = torch.zeros(4, 16)
        for d in range(dp):
            for c in range(cp):
                for i, mb in enumerate(rank_slice(batch, dp, d, cp, c, layout, 2)):
                    # global micro-batch i: rows 2i, 2i + 1, the same whatever dp
                    rows = slice(i * 2 + d * 2 // dp, i * 2 + (d + 1) * 2 // dp)
                    assert torch.equal(mb.ids, batch.ids[rows][:, mb.positions])
                    seen[rows, mb.positions] += mb.mask
        assert torch.equal(seen, batch.mask)  # every token that counts, exactly once


def test_varlen_pads_rows_unevenly_and_masks_the_padding():
    batch = global_batch(0, rows=8, seq_len=16, vocab=64, seed=1, varlen=True)
    counts = batch.mask.sum(1)
    assert len(set(counts.tolist())) > 2 and counts.min() < 16
    assert torch.all(batch.targets[batch.mask == 0] == 0)
    assert torch.equal(global_batch(0, 8, 16, 64, 1, varlen=True).ids, batch.ids)


class Gradients:
    """A hook: every parameter's reduced gradient after the first step's backward."""

    def __init__(self):
        self.grads = None

    def after_backward(self, step, par):
        if self.grads is None:
            self.grads = {n: p.grad.clone() for n, p in par.model.named_parameters()}


def _dp_gradients(rank, world_size, normalisation):
    from engine.compose.loop import train_step
    from engine.compose.parallelize import parallelize
    from engine.topology import Mesh

    plan = Plan(dp=2, micro_batches=2)
    par = parallelize(GPT(CFG, seed=0), Mesh(dp=2), plan, torch.optim.SGD, lr=0.0)
    hook = Gradients()
    batch = global_batch(0, 4, CFG.seq_len, CFG.vocab, seed=5, varlen=True)
    train_step(par, batch, hooks=[hook], normalisation=normalisation)
    return hook.grads


def test_global_token_loss_gives_one_process_gradients_and_the_naive_mean_does_not():
    batch = global_batch(0, 4, CFG.seq_len, CFG.vocab, seed=5, varlen=True)
    per_micro_batch = batch.mask.sum(1).tolist()  # dp2 x 2 micro-batches: one row each
    assert len(set(per_micro_batch)) > 1, per_micro_batch  # uneven: the case that matters
    model = GPT(CFG, seed=0)
    (masked_sum(model(batch.ids), batch.targets, batch.mask) / batch.tokens).backward()
    reference = {n: p.grad for n, p in model.named_parameters()}

    def largest_difference(grads):
        return max((grads[n] - g).abs().max().item() for n, g in reference.items())

    exact = run_ranks(_dp_gradients, 2, "global")
    naive = run_ranks(_dp_gradients, 2, "micro-batch-mean")
    scale = max(g.abs().max().item() for g in reference.values())
    assert max(largest_difference(g) for g in exact) <= 1e-6
    wrong = max(largest_difference(g) for g in naive)
    print(f"\ntokens per micro-batch {per_micro_batch}: naive mean off by {wrong:.2e} "
          f"(largest gradient {scale:.2e}), global-token loss exact")
    assert wrong > 1e-3 * scale and wrong > 1e-4


def _moe_state_with_router_losses(rank, world_size, pp, scaled):
    from dataclasses import replace

    from engine.compose import pipeline
    from engine.compose.loop import train
    from engine.compose.parallelize import parallelize
    from engine.compose.state import dense_state
    from engine.moe.layer import single_rank_group
    from engine.topology import Mesh

    if not scaled:  # what a stage without the scaler computes: router losses dropped
        pipeline.RouterLossScaler.apply = staticmethod(lambda out, losses, scale: out)
    cfg = replace(CFG, num_experts=4, top_k=2, capacity_factor=2.0, aux_loss_coef=0.01,
                  z_loss_coef=1e-3)
    model = GPT(cfg, seed=0, expert_group=single_rank_group())
    par = parallelize(model, Mesh(1, 1, pp), Plan(pp=pp, micro_batches=2), torch.optim.AdamW,
                      lr=1e-4)
    train(par, 3, 4, seed=1)
    return dense_state(par)


def test_each_pipeline_stage_adds_its_own_router_losses():
    """Megatron's MoEAuxLossAutoScaler: MoE pp2 with balancing and z-losses trains as one
    process with the same micro-batches; dropping the stages' router losses does not."""
    one = run_ranks(_moe_state_with_router_losses, 1, 1, True)[0]

    def largest_difference(states):
        return max((t - one[n]).abs().max().item() for s in states for n, t in s.items())

    assert largest_difference(run_ranks(_moe_state_with_router_losses, 2, 2, True)) <= 1e-6
    assert largest_difference(run_ranks(_moe_state_with_router_losses, 2, 2, False)) > 1e-5


def test_every_gpt_of_the_engine_is_the_one_definition_with_its_dense_bits():
    """The MoE GPT is the one :class:`engine.model.gpt.GPT`: the same attention class, and every
    dense parameter the dense model's bits for the same seed; only the experts (drawn under
    seed + 1) differ. (Tensor, context and expert parallelism change its modules in place:
    the parity matrix, tests/test_parity.py.)"""
    from engine.model.gpt import GPT as OneGPT
    from engine.model.gpt import Attention

    sizes = GPTConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32, kv_heads=2,
                      tied=False)
    dense = TinyGPT(sizes, seed=3).state_dict()
    composed = GPT(ModelConfig.from_gpt(sizes, num_experts=4), seed=3)
    assert isinstance(composed, OneGPT)
    assert all(type(block.attn) is Attention for block in composed.blocks)
    state = composed.state_dict()
    for name, value in dense.items():
        if ".fc." not in name and ".out." not in name:
            assert torch.equal(value, state[name]), name
    assert any(".moe.experts." in name for name in state)


def test_zero3s_optimizer_is_fused_where_the_device_has_the_kernel():
    from engine.compose.parallelize import multi_tensor

    cpu, meta = [torch.zeros(2, requires_grad=True)], [torch.zeros(2, device="meta")]
    assert multi_tensor(torch.optim.AdamW, {"lr": 1.0}, cpu) == {"fused": True, "lr": 1.0}
    assert multi_tensor(torch.optim.AdamW, {}, meta) == {"foreach": True}  # a dry run's
    assert multi_tensor(torch.optim.AdamW, {"foreach": False}, cpu) == {"foreach": False}
