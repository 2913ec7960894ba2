"""Mixture of experts (chapter 10).

Part of :mod:`engine.theory`: pure formulas, each naming its source; sizes in bytes.
"""

from __future__ import annotations

import math

from engine.theory.collectives import all_to_all_bytes


def expert_capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert when ``tokens`` each go to ``top_k`` of ``num_experts`` experts:
    ``ceil(tokens * k * capacity_factor / E)`` (Fedus et al., "Switch Transformers", JMLR 2022,
    eq. 3, for k = 1; Lepikhin et al., "GShard", ICLR 2021, section 2.2, for k = 2). A factor of
    1 leaves no slack: any imbalance drops tokens."""
    return math.ceil(tokens * top_k * capacity_factor / num_experts)


def moe_all_to_all_bytes(tokens: int, hidden: int, top_k: int, n: int, dtype_bytes: int = 4
                         ) -> dict[str, float]:
    """Bytes one rank sends (and receives) in the all-to-alls of one MoE layer under uniform
    routing with nothing dropped, for ``tokens`` tokens on the rank and experts spread over
    ``n`` ranks.

    The rank holds ``tokens * top_k`` (token, expert) rows of ``hidden`` values; 1/n of them
    go to its own experts, the rest cross the wire: ``(n-1)/n * tokens * k * h * dtype_bytes``
    per all-to-all (:func:`all_to_all_bytes`). Forward has two (dispatch to the experts,
    combine back), and backward the same two reversed (Lepikhin et al., "GShard", ICLR 2021:
    dispatch and combine as all-to-alls). The exchange of token counts before the dispatch
    (E integers) is not included."""
    one = all_to_all_bytes(tokens * top_k * hidden * dtype_bytes, n)
    return {"dispatch": one, "combine": one, "forward": 2 * one, "backward": 2 * one,
            "total": 4 * one}


def moe_params(layers: int, hidden: int, ffn_hidden: int, num_experts: int, top_k: int,
               vocab: int, kv_hidden: int | None = None, gated_ffn: bool = True,
               tied_embeddings: bool = False) -> dict[str, float]:
    """Total and active (used by one token) parameters of a decoder whose MLPs are MoE layers
    without biases, as in Mixtral (Jiang et al., "Mixtral of Experts", 2024, table 1).

    Per layer: attention ``2h^2 + 2h * kv_hidden`` (grouped-query attention: keys and values of
    ``kv_hidden`` = kv heads x head size; ``kv_hidden = h`` without it), a router ``h E``, two
    norms ``2h``, and ``E`` experts of ``m h f`` each (``m`` = 3 for a gated SwiGLU MLP, 2
    otherwise); plus a final norm and the embeddings ``V h`` (twice when the output layer is not
    tied). A token uses ``k`` experts, so it is active for ``k`` of them, not ``E``.
    Mixtral-8x7B (32 layers, h 4096, f 14336, 8 experts, top-2, kv 1024, V 32000): 46.7 B
    total, 12.9 B active (Mistral AI's announcement; "47B" and "13B" in the paper)."""
    kv = hidden if kv_hidden is None else kv_hidden
    expert = (3 if gated_ffn else 2) * hidden * ffn_hidden
    shared = 2 * hidden * hidden + 2 * hidden * kv + hidden * num_experts + 2 * hidden
    outside = hidden + vocab * hidden * (1 if tied_embeddings else 2)
    return {"total": layers * (shared + num_experts * expert) + outside,
            "active": layers * (shared + top_k * expert) + outside,
            "expert": expert}


def moe_forward_flops_per_token(layers: int, hidden: int, ffn_hidden: int, num_experts: int,
                                top_k: int, seq_len: int, kv_hidden: int | None = None,
                                gated_ffn: bool = True) -> float:
    """Forward FLOPs per token: ``2 N_active + 2 l s h``, with ``N_active`` the non-embedding
    parameters one token uses (Kaplan et al., "Scaling laws for neural language models", 2020,
    table 1: a multiply-add per parameter, plus attention over ``s`` positions). Training costs
    about 3x this (backward is twice the forward). ``top_k = num_experts`` gives the dense
    model with the same total parameters."""
    counts = moe_params(layers, hidden, ffn_hidden, num_experts, top_k, vocab=0,
                        kv_hidden=kv_hidden, gated_ffn=gated_ffn)
    return 2 * counts["active"] + 2 * layers * seq_len * hidden


def max_violation(load) -> float:
    """MaxVio, the imbalance of one batch's expert loads: ``max_i load_i / mean_i load_i - 1``
    (Wang et al., "Auxiliary-loss-free load balancing strategy for mixture-of-experts", 2024,
    eq. 4; DeepSeek-V3 plots it). 0 is perfect balance; 1: the busiest expert does twice the
    mean work, so under expert parallelism its rank takes about twice as long."""
    load = [float(x) for x in load]
    mean = sum(load) / len(load)
    if mean <= 0:
        raise ValueError(f"max_violation needs some load, got {load}")
    return max(load) / mean - 1


def fine_grained(ffn_hidden: int, num_experts: int, top_k: int, split: int) -> dict[str, int]:
    """Fine-grained experts (Dai et al., "DeepSeekMoE", 2024, section 3.1): each expert cut into
    ``split`` smaller ones (``ffn_hidden / split`` wide), ``split`` times as many experts and a
    top-k ``split`` times as large. Parameters and FLOPs per token stay the same; the number of
    expert combinations a token can use, ``C(E, k)``, grows enormously."""
    if split < 1 or ffn_hidden % split:
        raise ValueError(f"split = {split} must be a positive divisor of ffn_hidden = "
                         f"{ffn_hidden}")
    return {"ffn_hidden": ffn_hidden // split, "num_experts": num_experts * split,
            "top_k": top_k * split,
            "combinations": math.comb(num_experts * split, top_k * split)}


def mla_attention_params(hidden: int = 7168, heads: int = 128, q_lora_rank: int = 1536,
                         kv_lora_rank: int = 512, qk_nope_dim: int = 128, qk_rope_dim: int = 64,
                         v_head_dim: int = 128) -> int:
    """Parameters of one multi-head latent attention layer (DeepSeek-V2, 2024, section 2.1;
    DeepSeek-V3 keeps it), as the released model's weights are laid out: queries through a
    rank-``q_lora_rank`` bottleneck (down, its RMSNorm, up to ``heads`` x (nope + rope)); keys
    and values from one ``kv_lora_rank`` latent plus a shared rope key (down, its RMSNorm, up
    to ``heads`` x (nope + v)); the output projection ``heads v -> h``. Defaults: DeepSeek-V3."""
    q = hidden * q_lora_rank + q_lora_rank + q_lora_rank * heads * (qk_nope_dim + qk_rope_dim)
    kv = (hidden * (kv_lora_rank + qk_rope_dim) + kv_lora_rank
          + kv_lora_rank * heads * (qk_nope_dim + v_head_dim))
    return q + kv + heads * v_head_dim * hidden


def deepseek_moe_params(layers: int = 61, dense_layers: int = 3, hidden: int = 7168,
                        dense_ffn: int = 18432, moe_ffn: int = 2048, routed: int = 256,
                        shared: int = 1, top_k: int = 8, vocab: int = 129280,
                        attention: int | None = None) -> dict[str, float]:
    """Total and active parameters of a DeepSeekMoE decoder (DeepSeek-V3 by default, from its
    published configuration: 61 layers, the first 3 dense with a SwiGLU MLP of 18432, the
    others 1 shared + 256 routed SwiGLU experts of 2048, top-8, a router of ``E h`` weights and
    ``E`` balancing biases, multi-head latent attention (:func:`mla_attention_params`), two
    RMSNorms a layer, untied embeddings of 129280; the multi-token-prediction module is not
    counted). ``active`` counts both embedding tables; ``active_compute`` leaves out the input
    embedding, a row lookup that does no multiply. DeepSeek-V3's report gives 671 B total and
    37 B activated; the weights documentation of its repository (README_WEIGHTS.md) gives 671 B
    and 36.6 B activated "including 0.9B for the output Head": ``active_compute``."""
    attn = mla_attention_params(hidden) if attention is None else attention
    expert = 3 * hidden * moe_ffn
    common = attn + 2 * hidden
    dense = common + 3 * hidden * dense_ffn
    router = routed * hidden + routed
    moe_total = common + router + (shared + routed) * expert
    moe_active = common + router + (shared + top_k) * expert
    embeddings = 2 * vocab * hidden + hidden  # input, output, final norm
    sparse = layers - dense_layers
    total = dense_layers * dense + sparse * moe_total + embeddings
    active = dense_layers * dense + sparse * moe_active + embeddings
    return {"total": total, "active": active, "active_compute": active - vocab * hidden,
            "attention": attn, "expert": expert}
