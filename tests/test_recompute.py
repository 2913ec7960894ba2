"""Activation checkpointing measured on the tiny GPT: bytes saved for backward (saved-tensor
hooks), FLOPs (FlopCounterMode), gradients bit-identical under every policy, and the budget
policy fitting its budget; against the paper's per-layer formulas."""

from __future__ import annotations

import matplotlib
import pytest
import torch
import torch.utils.checkpoint

from engine import theory
from engine.model.gpt import GPTConfig, TinyGPT
from engine.model.data import token_data
from engine.precision.recompute import (PLANS, SavedBytes, budget_plan, gpt_forward, measure,
                                        pareto, per_block_costs, tiny_gpt_bytes_per_layer,
                                        tiny_gpt_flops_per_layer)
from engine.viz.recompute import plot_recompute_pareto

CFG = GPTConfig(vocab=64, seq_len=64, layers=4, heads=4, hidden=32)
B = 2
matplotlib.use("Agg")


@pytest.fixture(scope="module")
def runs():
    return {plan: measure(CFG, plan, B) for plan in PLANS}


def test_the_policies_forward_is_the_models_own():
    model = TinyGPT(CFG)
    idx, _ = token_data(B, CFG.seq_len, CFG.vocab, seed=1)
    assert torch.equal(gpt_forward(model, idx, ("none",) * CFG.layers, SavedBytes()), model(idx))


def test_bytes_and_flops_per_layer_are_the_counted_ones_and_gradients_bit_identical(runs):
    s, b, h, a = CFG.seq_len, B, CFG.hidden, CFG.heads
    outside = runs["none"].saved["outside"]
    head = 2 * b * s * h * CFG.vocab  # the tied output projection's forward matmul
    for plan, run in runs.items():
        per_layer = tiny_gpt_bytes_per_layer(CFG, B, plan)
        print(f"{plan:9s} saved {run.saved_bytes:8d} B ({per_layer} a layer), FLOPs {run.flops}")
        assert run.saved == {"outside": outside,
                             **{f"block {i}": per_layer for i in range(CFG.layers)}}
        assert run.flops == CFG.layers * tiny_gpt_flops_per_layer(CFG, B, plan) + 3 * head
        # recomputation reruns the same CPU kernels on the same inputs: the same bits
        for name, grad in runs["none"].grads.items():
            assert torch.equal(run.grads[name], grad), (plan, name)
    assert runs["none"].forward_flops == CFG.layers * (24 * b * s * h * h + 4 * b * s * s * h) \
        + head
    # the paper's bytes (fp16, dropout) against the tiny GPT's (fp32, no dropout, LN stats)
    paper = {p: theory.recompute_activation_bytes_per_layer(s, b, h, a, p) for p in PLANS}
    assert paper["none"] == theory.activation_bytes_per_layer(s, b, h, a)
    assert paper == {"none": 34 * s * b * h + 5 * a * s * s * b, "selective": 34 * s * b * h,
                     "full": 2 * s * b * h}
    measured = {plan: run.saved["block 0"] for plan, run in runs.items()}
    assert measured["none"] - measured["selective"] == 4 * a * s * s * b + s * s
    # the paper's 16 sbh-sized 16-bit tensors kept, in fp32, without its two sbh dropout masks,
    # plus LayerNorm's mean and 1/std
    assert measured["selective"] == 2 * (paper["selective"] - 2 * s * b * h) + 16 * s * b
    assert measured["full"] == 2 * paper["full"]  # the layer's input, in fp32 not 16-bit


def test_without_early_stop_full_recomputation_reruns_the_whole_forward():
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        late = measure(CFG, "full", B)
    s, b, h = CFG.seq_len, B, CFG.hidden
    none = measure(CFG, "none", B)
    assert late.flops - none.flops == CFG.layers * (24 * b * s * h * h + 4 * b * s * s * h)


def test_the_budget_policy_fits_its_budget_at_the_fewest_flops_it_finds(runs):
    costs = per_block_costs(runs)
    outside = runs["none"].saved["outside"]
    assert costs["selective"][0] < costs["none"][0] and costs["selective"][1] > 0
    # selective saves the most bytes per FLOP here: it comes first, on every block
    budget = runs["selective"].saved_bytes + 1
    assert budget_plan(costs, CFG.layers, budget, outside) == ("selective",) * CFG.layers
    plans = budget_plan(costs, CFG.layers, runs["selective"].saved_bytes - 1, outside)
    assert plans.count("full") == 1 and plans.count("selective") == CFG.layers - 1
    run = measure(CFG, plans, B)
    assert run.saved_bytes < runs["selective"].saved_bytes
    assert runs["selective"].flops < run.flops < runs["full"].flops
    assert all(torch.equal(run.grads[n], g) for n, g in runs["none"].grads.items())
    with pytest.raises(ValueError, match="budget=10 bytes: below"):
        budget_plan(costs, CFG.layers, 10, outside)
    with pytest.raises(ValueError, match="plans=\\('none', 'sometimes'"):
        measure(CFG, ("none", "sometimes", "none", "none"))


def test_the_pareto_points_trade_bytes_for_flops():
    points = sorted(pareto(CFG, B, budgets=6), key=lambda r: r.saved_bytes)
    print([(r.label, r.saved_bytes, r.flops) for r in points])
    assert points[0].label == "full" and points[-1].label == "none" and len(points) > 4
    for fewer, more in zip(points, points[1:]):
        assert fewer.flops > more.flops  # each byte less costs FLOPs: a Pareto front
    import matplotlib.pyplot as plt

    fig, _ = plot_recompute_pareto(CFG, B, points=points)
    assert len(fig.axes) == 2 and len(fig.axes[0].collections) == len(points)
    plt.close(fig)
