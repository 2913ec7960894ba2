"""Mixture-of-experts items (chapter 10): dropless routing, aux-loss-free balancing, shared and fine-grained experts, published model sizes.

Answers are computed by :mod:`engine.theory` (numeric items) or settled by a measurement in
the chapter (choice items); every item names the chapter section that teaches it.
"""

from __future__ import annotations

from engine.theory import hardware
from engine import theory
from engine.drill.items import Choice, Numeric
from engine.moe.redundant import imbalance_floor

C10 = "course/10_moe.ipynb"
DROPLESS = "Dropless MoE: no capacity, uneven batches"
AUX_FREE = "Aux-loss-free balancing: a bias on the choice"
SHARED = "Shared and fine-grained experts"
EXPERT_CHOICE = "Expert-choice routing"
SIZES = "Published model sizes: Mixtral and DeepSeek-V3"
REDUNDANT = "Redundant experts: balancing the GPUs at inference"
INFERENCE = "Expert capacity at inference"


def _max_violation(rng):
    experts = rng.choice([4, 8])
    load = [rng.choice([10, 20, 30, 40, 60, 90]) for _ in range(experts)]
    return (f"A batch's expert loads are {load} assignments: what is its MaxVio (max load / "
            "mean load - 1)?", theory.max_violation(load),
            f"max / mean - 1 (Wang et al. 2024, as DeepSeek-V3 plots it); 0 is perfect balance. "
            f"Chapter 10, '{AUX_FREE}'.")


def _deepseek_active(rng):
    top_k, shared = rng.choice([4, 6, 8]), rng.choice([1, 2])
    p = theory.deepseek_moe_params(top_k=top_k, shared=shared)
    return (f"DeepSeek-V3's shape (61 layers, the first 3 dense with a SwiGLU MLP of 18432; then "
            f"{shared} shared + 256 routed SwiGLU experts of 2048, hidden 7168, multi-head latent "
            f"attention of 187.1 M parameters a layer, vocab 129280, untied) with top-{top_k}: "
            "billions of parameters one token uses, counting the output layer but not the "
            "input embedding (a lookup)?", p["active_compute"] / 1e9,
            "Attention, norms and routers of every layer, the 3 dense MLPs, shared + k experts "
            "(3 h f each) per MoE layer, the output layer. With 1 shared and top-8: 36.6 B, as "
            f"DeepSeek-V3's weights documentation counts it (the report rounds to 37B). "
            f"Chapter 10, '{SIZES}'.")


def _deepseek_total(rng):
    routed = rng.choice([64, 128, 256])
    p = theory.deepseek_moe_params(routed=routed)
    return (f"DeepSeek-V3's shape (61 layers, 3 dense with an MLP of 18432, 1 shared + {routed} "
            "routed SwiGLU experts of 2048, hidden 7168, MLA attention of 187.1 M a layer, vocab "
            "129280, untied embeddings): billions of parameters in all?", p["total"] / 1e9,
            "58 MoE layers x (shared + routed) x 3 h f dominate; with 256 routed experts: "
            f"671 B, the published total. Chapter 10, '{SIZES}'.")


def _fine_grained(rng):
    split, ffn = rng.choice([2, 4, 8]), rng.choice([14336, 16384])
    fine = theory.fine_grained(ffn, 8, 2, split)
    return (f"8 experts of SwiGLU width {ffn}, top-2, cut fine-grained into {split} times as many "
            f"experts, each {split} times narrower, top-{2 * split}: how many times more expert "
            "combinations can a token use (C(E, k) after over before)?",
            fine["combinations"] / theory.fine_grained(ffn, 8, 2, 1)["combinations"],
            "Same parameters, same FLOPs per token; C(8m, 2m) / C(8, 2) more ways to combine "
            f"experts (DeepSeekMoE, section 3.1). Chapter 10, '{SHARED}'.")


def _expert_choice_tokens(rng):
    tokens, experts, c = rng.choice([1024, 4096]), rng.choice([8, 16, 64]), rng.choice([1, 2])
    return (f"Expert-choice routing, {tokens} tokens, {experts} experts, capacity factor {c} "
            "(the experts per token on average): how many tokens does each expert take?",
            float(theory.expert_capacity(tokens, experts, 1, c)),
            f"ceil(T c / E): every expert takes exactly that many, so the load is balanced by "
            f"construction (Zhou et al. 2022). Chapter 10, '{EXPERT_CHOICE}'.")


def _a2a_over_the_network(rng):
    tokens, k = rng.choice([4096, 8192]), rng.choice([2, 8])
    gpu = hardware.GPU_SPECS["NVIDIA H100 80GB HBM3"]
    sent = theory.moe_all_to_all_bytes(tokens, 7168, k, 8, 2)["total"]
    return (f"8-way expert parallelism spread over nodes, {tokens} tokens per GPU, hidden 7168, "
            f"top-{k}, bf16, uniform routing: how many ms do the four all-to-alls of one MoE "
            f"layer take at 400G InfiniBand's {gpu.network_gbps:g} GB/s per GPU (bandwidth term "
            "only)?", sent / (gpu.network_gbps * 1e9) * 1e3,
            "4 x (n-1)/n x T k h x 2 bytes over 50 GB/s; inside an H100 node NVLink's 450 GB/s "
            "makes it 9x shorter (engine.theory.hardware), which is why the group stays in a node. "
            "Chapter 10, 'Why all-to-all across nodes hurts'.")


def _redundant_floor(rng):
    gpus, share = rng.choice([8, 16, 32]), rng.choice([0.15, 0.2, 0.3, 0.4])
    copies = rng.choice([1, 2, 4])
    return (f"Serving an MoE layer on {gpus} GPUs, the hottest expert receives {share:.0%} of the "
            "layer's token-assignments; "
            + ("it has one copy (no redundant experts)" if copies == 1 else
               f"its tokens are split evenly over {copies} copies on different GPUs")
            + ". However the other experts are "
            "placed, the busiest GPU's load is at least what multiple of the mean GPU load?",
            imbalance_floor(share, gpus, copies),
            "One copy's GPU takes share / copies of all tokens against a fair 1 / G: max(1, "
            "share x G / copies). No rearrangement of whole experts goes below it; redundant "
            f"copies (DeepSeek-V3, section 3.4) do. Chapter 10, '{REDUNDANT}'.")


ITEMS: list = [  # Numeric, Choice and Outline items of topic 'moe'
    Numeric("moe-redundant-floor", "moe", _redundant_floor, unit="x"),
    Numeric("moe-max-violation", "moe", _max_violation, unit="x"),
    Numeric("moe-deepseek-active", "moe", _deepseek_active, unit="billion"),
    Numeric("moe-deepseek-total", "moe", _deepseek_total, unit="billion"),
    Numeric("moe-fine-grained-combinations", "moe", _fine_grained, unit="x"),
    Numeric("moe-expert-choice-tokens", "moe", _expert_choice_tokens, unit="tokens"),
    Numeric("moe-a2a-over-infiniband", "moe", _a2a_over_the_network, unit="ms"),
    Choice("moe-fixed-capacity-why", "moe",
           "A common answer: experts get a fixed number of slots because the ranks must agree on "
           "the all-to-all's shapes beforehand. What does capacity really buy?",
           ("A bound on the busiest expert's work and buffers; the counts are exchanged before "
            "the rows anyway, and GPU training is usually dropless",
            "The all-to-all cannot send uneven splits, so capacity is required",
            "Without capacity the router's gradient is undefined"), 0,
           "The engine's dispatch exchanges counts and sends uneven splits; with "
           "capacity_factor=None it drops nothing and equals one process (MegaBlocks, "
           "Megatron-Core, DeepSeek-V3 are dropless).", (C10, DROPLESS)),
    Choice("moe-aux-free-where", "moe",
           "DeepSeek-V3 balances experts with a per-expert bias. Where does the bias act?",
           ("On the scores used to choose the top-k only; the gates come from the unbiased "
            "scores, and no gradient reaches the bias",
            "On the gates, so overloaded experts contribute less",
            "As an extra term in the loss, like Switch's"), 0,
           "After each step b_i += gamma sign(mean load - load_i), gamma = 0.001; the chapter's "
           "run lowers MaxVio against no balancing, on the same data.", (C10, AUX_FREE)),
    Choice("moe-expert-choice-catch", "moe",
           "Expert-choice routing balances the load perfectly. What does it give up?",
           ("Causality: an expert picks among all the batch's tokens, future ones included, and "
            "a token may get no expert at all",
            "Nothing: it is strictly better than top-k",
            "Parallelism: it cannot be spread over ranks"), 0,
           "Each expert takes its top-c tokens; the chapter counts the tokens no expert chose.",
           (C10, EXPERT_CHOICE)),
    Choice("moe-inference-dropless", "moe",
           "An MoE trained with capacity factor 1.25 goes to serving. Why do servers usually run it "
           "dropless (or with a much larger capacity)?",
           ("With a capacity, whether a token is dropped depends on the batch it was served in "
            "(its size and the other requests' routing), so the same prompt gets different "
            "outputs under different traffic; dropless makes each token's output depend on it "
            "alone", "Dropping is cheaper at inference, so servers drop more, not less",
            "Capacity only exists in training, because it is part of the loss"), 0,
           "The chapter serves the same tokens in different batches: with capacity 1.0 tens of "
           "tokens change output, dropless none; the GPUs are balanced with redundant experts "
           "instead.", (C10, INFERENCE)),
]
