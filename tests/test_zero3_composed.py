"""The composed engine's ZeRO-3 (:mod:`engine.fsdp`, per parameter) with what a run adds to it:
activation checkpointing (the GPT's ``checkpoint=True``) and bf16 (``engine train --precision
bf16``: a :class:`engine.fsdp.MixedPrecisionPolicy` passed through ``parallelize``)."""

from __future__ import annotations

import pytest
import torch

from engine.compose.loop import train
from engine.compose.loss import masked_sum
from engine.compose.model import GPT
from engine.compose.parallelize import parallelize
from engine.compose.parity import LR, MODEL, ROWS, SEED, STEPS, TOLERANCE, reference
from engine.compose.plan import Plan
from engine.compose.state import dense_state
from engine.compose.traffic import bytes_by_kind
from engine.observe.meter import CommMeter
from tests.helpers import run_ranks


def _checkpointed(rank, world_size, plan, checkpoint):
    mesh = plan.mesh()
    par = parallelize(GPT(MODEL, seed=SEED, checkpoint=checkpoint), mesh, plan,
                      torch.optim.AdamW, lr=LR)
    with CommMeter(count="wire") as meter:
        losses = train(par, STEPS, ROWS, seed=SEED + 1)
    sharding = par.model.sharded_step
    return dict(losses=losses, state=dense_state(par), dp=bytes_by_kind(meter.events, mesh, False)["dp"],
                gathered=sharding.gathered_bytes, peak=sharding.peak_gathered_bytes,
                leaves=all(p.is_leaf for p in par.model.parameters()))


@pytest.mark.parametrize("plan", [Plan(dp=2, zero=3, micro_batches=2),
                                  Plan(dp=2, pp=2, zero=3, micro_batches=2)],
                         ids=lambda plan: plan.name.replace(" ", "-"))
def test_activation_checkpointing_trains_as_one_process(plan):
    """Each block recomputed in its backward (``torch.utils.checkpoint``): the recompute runs
    the block's forward with the parameters gathered for its backward (PyTorch FSDP2's
    pre-backward state), so the losses and parameters are one process's within the parity
    tolerance and no whole tensor outlives the step. Before, the recompute gathered tensors
    that no backward freed: the blocks' slots kept them (``model.parameters()`` were not the
    shards) and 556,032 B stayed gathered after 3 steps (dp2)."""
    ref = reference(MODEL, False)
    plain = run_ranks(_checkpointed, plan.world, plan, False, timeout=60)
    for rank, (ours, theirs) in enumerate(zip(run_ranks(_checkpointed, plan.world, plan, True,
                                                        timeout=60), plain, strict=True)):
        assert max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"])) <= TOLERANCE
        assert max((t - ref["state"][n]).abs().max().item()
                   for n, t in ours["state"].items()) <= TOLERANCE, rank
        assert ours["gathered"] == 0 and ours["leaves"]
        if plan.pp == 1:  # the recompute gathers nothing more: the same bytes, the same peak
            assert (ours["dp"], ours["peak"]) == (theirs["dp"], theirs["peak"])


def _held_between_forward_and_backward(rank, world_size, precision):
    """One step of ``engine train --dp 2 --zero 3 --precision {precision}``'s strategy on this
    rank: what autograd holds for backward when the model's forward returns
    (:meth:`engine.observe.memory.ActivationTracker.held`) and the step's loss; the same for
    one process's model cast to bf16, its blocks' weights aside (a rank of ZeRO-3 frees them)
    on this rank's rows, and its loss on the global batch."""
    from engine.compose.data import rank_slice
    from engine.model.data import global_batch
    from engine.observe.memory import ActivationTracker
    from engine.train.cli import TrainConfig
    from engine.train.composed import composed_strategy, global_rows, model_config, plan_of

    cfg = TrainConfig(dp=2, zero=3, model="small", microbatches=1, micro_batch=1)
    plan = plan_of(cfg)
    strategy = composed_strategy(cfg, plan, plan.mesh(), torch.device("cpu"), precision)
    seen = {}

    def after_forward(*_) -> None:
        seen["held"] = acts.held()

    with ActivationTracker() as acts:
        strategy.model.register_forward_hook(after_forward)
        loss = strategy.step(0).loss
    model_cfg = model_config(cfg)
    batch = global_batch(0, global_rows(cfg), model_cfg.seq_len, model_cfg.vocab, cfg.seed + 1)
    mine = rank_slice(batch, plan.dp, rank, micro_batches=1)[0]
    one = GPT(model_cfg, seed=cfg.seed).to(torch.bfloat16)
    with ActivationTracker(exclude=one.blocks.parameters()) as ref, \
            torch.autocast("cpu", dtype=torch.bfloat16):
        out = one(mine.ids, mine.positions)
        one_process = ref.held()
    del out
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        whole = masked_sum(one(batch.ids), batch.targets, batch.mask).item() / batch.tokens
    return dict(held=seen["held"], one_process=one_process, loss=loss, whole=whole)


def test_a_bf16_zero3_rank_holds_no_copy_of_its_weights_between_forward_and_backward():
    """``--precision bf16 --zero 3`` gathers the parameters in bf16 and reduces the gradients
    in fp32 (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, from the
    trainer through ``parallelize``): between forward and backward a rank holds what one
    process of the bf16 model holds for its rows, its blocks' weights aside, which ZeRO-3 has
    freed: the activations and the root's embeddings and final norm (1,298,176 B, ``--model
    small``, one row). Before, the gathered fp32 weights went through autocast, whose bf16 copy
    of every block's matrix autograd kept until backward: 3,021,312 B held (measured)."""
    for ours in run_ranks(_held_between_forward_and_backward, 2, "bf16", timeout=60):
        assert ours["held"] == ours["one_process"], ours
        # the same bf16 products row by row: the step's global loss is one process's
        assert abs(ours["loss"] - ours["whole"]) <= TOLERANCE, ours


def test_bf16_zero3_sends_its_gathers_in_bf16_and_counts_them(capsys):
    """``engine train --precision bf16 --zero 3`` (dp2 x pp2): each all-gather carries bf16,
    each reduce-scatter fp32; the dp bytes counted on the wire equal the formula with the
    policy's bytes (``gathered x 0.5``), two thirds of fp32's (rank 0: 121,348 B against
    182,020 B, measured; before, bf16 sent fp32's bytes: autocast cast after the gather)."""
    import re

    from engine.__main__ import main as engine_main

    sent = {}
    for precision in ("fp32", "bf16"):
        assert engine_main(["train", "--dp", "2", "--pp", "2", "--zero", "3", "--precision",
                            precision, "--steps", "2"]) == 0
        traffic = capsys.readouterr().out.split("bytes sent per step", 1)[1]
        ranks = [line for line in traffic.splitlines() if line.startswith("    rank ")][:4]
        cells = [re.search(r"dp ([\d,]+) B = ([\d,]+) B", line).groups() for line in ranks]
        assert all(counted == formula for counted, formula in cells), ranks
        sent[precision] = [int(counted.replace(",", "")) for counted, _ in cells]
    assert "gathered x 0.5 and reduced x 1 (MixedPrecisionPolicy)" in traffic
    assert all(b < f for b, f in zip(sent["bf16"], sent["fp32"])), sent
