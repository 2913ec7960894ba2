"""Numeric drill items: every answer comes from :mod:`engine.theory` at drawn parameters."""

from __future__ import annotations

import itertools

from engine import theory
from engine.drill.items import Numeric

MB, GB = 2**20, 1e9


def _ring_bytes(rng):
    n, m = rng.choice([2, 4, 8, 16, 64]), rng.choice([25, 100, 400])
    return (f"Ring all-reduce of a {m} MB gradient over {n} GPUs: how many MB does each GPU "
            "send?", theory.ring_all_reduce_bytes(m, n), "2(N-1)/N x M, about 2M for large N.")


def _flat_broadcast(rng):
    n, m = rng.choice([4, 8, 16]), rng.choice([10, 100, 400])
    sent, _ = theory.flat_broadcast_bytes(m, n, rank=0)
    return (f"A flat broadcast of {m} MB from one rank to {n} ranks in all: how many MB does "
            "the root send?", sent, "(N-1) x S, one copy for each other rank. A chain or a "
            "tree spreads those copies over the ranks; the total stays N-1 copies.")


def _ps_server(rng):
    n, m = rng.choice([4, 8, 16]), rng.choice([100, 200])
    return (f"Parameter server among {n} ranks, gradient {m} MB: how many MB does the server "
            "receive per step?", theory.ps_all_reduce_bytes(m, n)["server_received"],
            "(N-1) x M: every worker sends it the whole gradient; its link is the bottleneck.")


def _ps_over_ring(rng):
    n = rng.choice([4, 8, 16, 32])
    ps = theory.ps_all_reduce_bytes(1.0, n)["server_received"]
    return (f"{n} ranks: the parameter server's inbound traffic is how many times a ring rank's "
            "outbound traffic?", ps / theory.ring_all_reduce_bytes(1.0, n),
            "(N-1)M / (2(N-1)M/N) = N/2.")


def _ring_rounds(rng):
    n = rng.choice([4, 8, 16, 64])
    return (f"How many sequential message rounds (the latency term's count) does a ring "
            f"all-reduce take on {n} GPUs?", theory.all_reduce_steps("ring", n),
            "2(N-1): N-1 for reduce-scatter, N-1 for all-gather.")


def _tree_rounds(rng):
    n = rng.choice([8, 16, 64, 256])
    return (f"How many sequential message rounds does a binomial-tree all-reduce (reduce up, "
            f"broadcast down) take on {n} GPUs?",
            theory.all_reduce_steps("tree", n), "2 log2 N: why trees win for small messages.")


def _alpha_beta(rng):
    n, mb = rng.choice([4, 8]), rng.choice([16, 64])
    alpha, beta = 1e-5, 1 / 10e9
    t = theory.alpha_beta_time("ring", mb * MB, n, alpha, beta)
    return (f"alpha = 10 us, bandwidth 10 GB/s, ring all-reduce of {mb} MiB on {n} GPUs: "
            "predicted time in ms?", t * 1e3, "2(N-1) alpha + 2(N-1)/N S / bandwidth.")


def _busbw(rng):
    n, mb, ms = rng.choice([4, 8]), rng.choice([64, 256]), rng.choice([5, 10, 20])
    bw = theory.bus_bandwidth("all_reduce", mb * 1e6, ms / 1e3, n)
    return (f"nccl-tests reports an all-reduce of {mb} MB on {n} GPUs in {ms} ms. Bus bandwidth "
            "in GB/s?", bw / 1e9, "algbw = S/t; busbw = algbw x 2(N-1)/N.")


def _grad_accum(rng):
    k, buckets = rng.choice([4, 8, 16]), rng.choice([1, 3, 5])
    return (f"Gradient accumulation over {k} micro-batches with no_sync on all but the last, "
            f"{buckets} buckets: all-reduces per optimizer step?", float(buckets),
            "One per bucket, once: the other backward passes only accumulate.")


def _effective_batch(rng):
    micro, k, n = rng.choice([4, 8]), rng.choice([2, 4, 8]), rng.choice([8, 32])
    return (f"Micro-batch {micro}, {k} accumulation steps, {n} data-parallel GPUs: the "
            "effective global batch?", float(micro * k * n), "micro-batch x k x N.")


def _amdahl(rng):
    compute, n = rng.choice([0.1, 0.2, 0.5]), rng.choice([8, 64])
    params = rng.choice([25e6, 100e6])
    comm = theory.alpha_beta_time("ring", 4 * params, n, 1e-5, 1 / 10e9)
    return (f"{params / 1e6:.0f} M fp32 gradients, {compute} s of compute per step, {n} GPUs, "
            "alpha 10 us, 10 GB/s, no overlap: scaling efficiency in percent?",
            100 * compute / (compute + comm), "compute / (compute + all-reduce time).")


def _grad_mb(rng):
    params = rng.choice([25.6e6, 110e6, 340e6])
    return (f"A model with {params / 1e6:.1f} M parameters: MB of fp32 gradients?",
            4 * params / 1e6, "4 bytes per parameter.")


def _topk_bytes(rng):
    n, ratio = rng.choice([4, 8, 16]), rng.choice([0.01, 0.001])
    numel = 10_000_000
    return (f"Top-K at ratio {ratio} of a 10 M-element fp32 gradient, int32 indices, gathered "
            f"over {n} GPUs: MB each GPU sends?",
            theory.topk_bytes_per_rank(numel, ratio, n) / 1e6, "(N-1) x k x (4 + 4) bytes.")


def _topk_fraction(rng):
    n, ratio = rng.choice([4, 8, 16]), rng.choice([0.01, 0.02, 0.05])
    numel = 1_000_000
    return (f"Top-K at {ratio:.0%} on {n} GPUs: its traffic per GPU as a percent of a dense "
            "fp32 ring all-reduce?",
            100 * theory.topk_bytes_per_rank(numel, ratio, n)
            / theory.ring_all_reduce_bytes(4 * numel, n), "N x ratio: it grows with N.")


def _topk_breakeven(rng):
    n = rng.choice([4, 8, 16, 32])
    return (f"{n} GPUs: above which ratio does Top-K (values + int32 indices, all-gather) send "
            "more than a dense ring all-reduce?", theory.topk_breakeven_ratio(n),
            "Equal at k/numel = 1/N.")


def _powersgd_elements(rng):
    n, m, r = rng.choice([1024, 4096]), rng.choice([1024, 4096]), rng.choice([1, 4])
    return (f"PowerSGD rank {r} on a {n} x {m} gradient: elements sent instead of {n * m}?",
            float(theory.powersgd_elements([(n, m)], r)[1]), "(n + m) x r.")


def _powersgd_ratio(rng):
    n, r = rng.choice([1024, 4096]), rng.choice([1, 2, 4, 8])
    before, after = theory.powersgd_elements([(n, n)], r)
    return (f"PowerSGD rank {r} on a square {n} x {n} matrix: compression factor?",
            before / after, "n^2 / (2 n r) = n / 2r.")


def _fp16_bytes(rng):
    params = rng.choice([100e6, 1.3e9])
    return (f"{params / 1e6:.0f} M gradients sent as fp16 instead of fp32: MB saved per "
            "all-reduce payload?", 2 * params / 1e6, "2 bytes per element.")


def _zero_bytes(rng):
    psi, n, stage = rng.choice([7.5e9, 13e9, 70e9]), rng.choice([4, 8, 64]), rng.randint(0, 3)
    return (f"{psi / 1e9:g} B parameters, mixed-precision Adam, {n} GPUs, ZeRO stage {stage}: "
            "GB of model states per GPU?",
            theory.zero_model_state_bytes(psi, n, stage)["total"] / GB,
            "2 + 2 + 12 bytes per parameter; stage s shards the first s of optimizer, "
            "gradients, parameters.")


def _zero_saving(rng):
    n, stage = rng.choice([2, 4, 8, 16]), rng.choice([1, 2])
    total = theory.zero_model_state_bytes(1.0, n, stage)["total"]
    return (f"ZeRO-{stage} on {n} GPUs: by what factor does it cut model-state memory "
            "(16 psi)?", 16 / total, "Not 4x or 8x: those are limits as N grows.")


def _zero_comm(rng):
    n, stage = rng.choice([4, 8, 64]), rng.choice([1, 2, 3])
    return (f"ZeRO stage {stage} on {n} GPUs: elements each GPU sends per step, as a multiple "
            "of psi?", theory.zero_comm_elements(1.0, n, stage),
            "2(N-1)/N for stages 0-2, 3(N-1)/N for stage 3.")


def _plain_dp_states(rng):
    psi = rng.choice([7e9, 70e9, 175e9])
    return (f"Plain data parallelism, {psi / 1e9:g} B parameters, mixed-precision Adam: TB of "
            "model states on every GPU?",
            theory.zero_model_state_bytes(psi, 1, stage=0)["total"] / 1e12,
            "16 bytes per parameter.")


def _offload(rng):
    psi, n = rng.choice([7e9, 13e9]), rng.choice([8, 16])
    return (f"ZeRO-Offload with {psi / 1e9:g} B parameters on {n} GPUs: GB moved over PCIe per "
            "GPU per step (fp16 gradient shard down, parameter shard up)?",
            theory.offload_pcie_bytes(psi, n) / GB, "2 x 2 psi / N bytes.")


def _tp_elements(rng):
    b, s, h, t = rng.choice([1, 4]), rng.choice([1024, 2048]), rng.choice([4096, 8192]), \
        rng.choice([2, 4, 8])
    return (f"Megatron TP of degree {t}, micro-batch {b}, sequence {s}, hidden {h}: million "
            "elements each GPU sends per layer (forward + backward)?",
            theory.tp_comm_elements_per_layer(b, s, h, t) / 1e6,
            "4 all-reduces of bsh: 8bsh(t-1)/t.")


def _tp_allreduces(rng):
    layers = rng.choice([24, 32, 96])
    return (f"A {layers}-layer transformer under Megatron TP: all-reduces per micro-batch in "
            "the transformer layers, forward and backward (no recomputation)?", 4.0 * layers,
            "2 forward and 2 backward per layer. The vocabulary-parallel ends add five more: "
            "the embedding's output and the loss's max, sum and target logit going forward, the "
            "output layer's input gradient going back: 4L + 5 in all in the engine's GPT.")


def _layer_params(rng):
    h = rng.choice([4096, 8192, 12288])
    return (f"Hidden size {h}: billions of parameters in one transformer layer (12 h^2)?",
            12 * h * h / 1e9, "4h^2 attention + 8h^2 MLP.")


def _activations(rng):
    s, h, a, t = 2048, rng.choice([4096, 12288]), rng.choice([32, 96]), rng.choice([1, 8])
    return (f"Sequence {s}, micro-batch 1, hidden {h}, {a} heads, TP {t}, no recomputation: MB "
            "of activations per layer per GPU?",
            theory.tp_activation_bytes_per_layer(s, 1, h, a, t) / 1e6,
            "s b h (10 + 24/t + 5as/(ht)) (Korthikanti et al.).")


def _crossover(rng):
    h = rng.choice([1024, 4096, 8192])
    return (f"Hidden size {h}: tokens per micro-batch (b x s) where TP and ZeRO-3 send the "
            "same per layer?", theory.tp_zero3_crossover_tokens(h),
            "8bsh = 3 x (12h^2 + 13h): about 4.5 h.")


def _bubble_total(rng):
    p, m = rng.choice([2, 4, 8]), rng.choice([4, 8, 16, 32])
    return (f"GPipe or 1F1B, {p} stages, {m} micro-batches: bubble as a fraction of total "
            "time?", theory.bubble_fraction(p, m), "(p-1)/(m+p-1).")


def _bubble_ideal(rng):
    p, m = rng.choice([4, 8]), rng.choice([8, 32, 64])
    return (f"GPipe or 1F1B, {p} stages, {m} micro-batches: bubble relative to the ideal "
            "(busy) time?", theory.bubble_fraction(p, m, relative_to="ideal"), "(p-1)/m.")


def _bubble_interleaved(rng):
    p, v, k = rng.choice([4, 8]), rng.choice([2, 4]), rng.choice([1, 2, 4])
    m = p * k
    return (f"Interleaved 1F1B, {p} stages, {v} chunks per GPU, {m} micro-batches: bubble as a "
            "fraction of total time?", theory.bubble_fraction(p, m, v), "(p-1)/(vm+p-1).")


def _choose_m(rng):
    p, target = rng.choice([4, 8, 16]), rng.choice([0.1, 0.05])
    smallest = next(m for m in itertools.count(1)
                    if theory.bubble_fraction(p, m, relative_to="ideal") < target)
    return (f"{p} stages: smallest m keeping the bubble under {target:.0%} of the ideal time?",
            float(smallest), "(p-1)/m < target: m > (p-1)/target.")


def _inflight_1f1b(rng):
    p, s = rng.choice([4, 8]), rng.randint(0, 3)
    return (f"1F1B with {p} stages and many micro-batches: at most how many micro-batches' "
            f"activations does stage {s} hold?", float(p - s), "p - s: the warm-up plus one.")


def _zb_h1_bubble(rng):
    p, k = rng.choice([4, 8]), rng.choice([2, 4, 8])
    t_b, t_w = rng.choice([1.0, 1.5, 2.0]), rng.choice([0.5, 1.0])
    return (f"ZB-H1, {p} stages, {p * k} micro-batches; per stage and micro-batch the forward "
            f"takes 1, the input gradient B {t_b:g}, the weight gradient W {t_w:g}: bubble as a "
            "fraction of total time?",
            theory.zb_h1_bubble_fraction(p, p * k, 1.0, t_b, t_w),
            "Idle (p-1)(F+B-W) over m(F+B+W) plus that idle; B is the input gradient alone.")


def _zb_h1_readme(rng):
    p, t_w = rng.choice([4, 8, 16]), rng.choice([0.5, 1.0])
    t_full = rng.choice([2.0, 2.5, 3.0])
    return (f"The DualPipe README gives ZB1P's bubble as (PP-1)(F+B-2W). PP = {p}, F = 1, the "
            f"full backward B = {t_full:g}, W = {t_w:g}: idle time per stage, in units of F?",
            theory.zb_h1_bubble_time(p, 1.0, t_full, t_w, b="full"),
            "B there is the full backward: (PP-1)(F+B_full-2W) = (p-1)(F+B_input-W), the paper's "
            "formula.")


def _zb_h1_over_1f1b(rng):
    t_b, t_w = rng.choice([1.0, 2.0]), rng.choice([0.5, 1.0])
    return (f"Forward 1, input gradient {t_b:g}, weight gradient {t_w:g} per stage: ZB-H1's "
            "idle time per stage as a fraction of 1F1B's?",
            theory.zb_h1_bubble_time(4, 1.0, t_b, t_w) /
            theory.one_f_one_b_bubble_time(4, 1.0, t_b, t_w),
            "(F+B-W)/(F+B+W): a third when the three are equal.")


def _inflight_gpipe(rng):
    m = rng.choice([8, 16, 32])
    return (f"GPipe with {m} micro-batches: micro-batches' activations held by the first stage "
            "at the peak?", float(m), "All m: every forward runs before any backward.")


def _params(rng):
    layers, h = rng.choice([(96, 12288), (80, 8192), (32, 4096)])
    return (f"{layers} layers, hidden {h}, vocabulary 51200, sequence 2048: billions of "
            "parameters (Megatron-LM eq. 2)?", theory.transformer_params(layers, h) / 1e9,
            "12 l h^2 (1 + 13/(12h) + (V+s)/(12lh)).")


def _days(rng):
    tokens, gpus, x = rng.choice([300e9, 1e12]), rng.choice([1024, 3072]), \
        rng.choice([120e12, 140e12])
    return (f"175 B parameters, {tokens / 1e9:g} B tokens, {gpus} GPUs at {x / 1e12:g} "
            "TFLOP/s with activation recomputation: days?",
            theory.training_days(tokens, 175e9, gpus, x), "8 T P / (n X) seconds.")


def _flops(rng):
    batch = rng.choice([512, 1536])
    return (f"GPT-3 (96 layers, h 12288, V 51200), {batch} sequences of 2048 tokens, with "
            "recomputation: exaFLOPs per step?",
            theory.transformer_flops(batch, 2048, 96, 12288) / 1e18,
            "96 B s l h^2 (1 + s/(6h) + V/(16lh)).")


def _global_batch(rng):
    dp, mb, m = rng.choice([8, 64]), rng.choice([1, 2]), rng.choice([8, 16])
    return (f"dp {dp}, micro-batch {mb}, {m} micro-batches per pipeline: global batch in "
            "sequences?", float(dp * mb * m), "dp x micro-batch x m.")


def _states_3d(rng):
    tp, pp, dp, stage = 8, rng.choice([4, 8, 16]), rng.choice([8, 16, 32]), rng.choice([1, 2])
    psi = 175e9
    return (f"GPT-3 on tp {tp} x pp {pp} x dp {dp}, ZeRO-{stage}, mixed precision: GB of model "
            "states per GPU?",
            theory.zero_model_state_bytes(psi / (tp * pp), dp, stage)["total"] / GB,
            "psi/(tp pp) parameters per GPU, then the ZeRO formula over dp.")


def _moe_capacity(rng):
    t, e, k, cf = rng.choice([1024, 2048, 4096]), rng.choice([8, 16, 64]), rng.choice([1, 2]), \
        rng.choice([1.0, 1.25, 2.0])
    return (f"{t} tokens per GPU, {e} experts, top-{k} routing, capacity factor {cf}: token slots "
            "per expert?", float(theory.expert_capacity(t, e, k, cf)), "ceil(T k cf / E).")


def _moe_dispatch_bytes(rng):
    n, t, h, k = rng.choice([4, 8, 16]), rng.choice([2048, 4096]), rng.choice([4096, 7168]), \
        rng.choice([1, 2, 8])
    sent = theory.moe_all_to_all_bytes(t, h, k, n, 2)
    return (f"{n}-way expert parallelism, {t} tokens per GPU, hidden {h}, top-{k}, bf16, uniform "
            "routing: MB (10^6 bytes) each GPU sends in one MoE layer, forward and backward?",
            sent["total"] / 1e6, "Four all-to-alls (dispatch and combine, each way), each "
            "(n-1)/n x T k h x 2 bytes.")


def _moe_active(rng):
    layers, e, k = rng.choice([32, 56]), rng.choice([8, 16]), rng.choice([1, 2])
    p = theory.moe_params(layers, 4096, 14336, e, k, 32000, kv_hidden=1024)
    return (f"A Mixtral-shaped decoder (h 4096, SwiGLU experts of 14336, 8 kv heads of 128, vocab "
            f"32000) with {layers} layers, {e} experts, top-{k}: billions of parameters one token "
            "uses?", p["active"] / 1e9, "Shared attention, norms, routers and embeddings, plus "
            "k experts per layer (3 h f each), not E.")


def _ring_attention_gb(rng):
    n, s, kv = rng.choice([4, 8, 16]), rng.choice([32768, 131072]), rng.choice([1024, 4096])
    return (f"Ring attention over {n} GPUs, one sequence of {s:,} tokens, K/V width {kv} (KV "
            "heads x head dim), bf16: GB each GPU sends in one layer's forward?",
            theory.ring_attention_bytes(s, kv, n, 2)["forward"] / 1e9,
            "2 (N-1) (S/N) kv x 2 bytes: one K/V block per step, N-1 steps; ~2 S kv whatever N.")


def _ulysses_gb(rng):
    n, s = rng.choice([2, 4, 8]), rng.choice([32768, 131072])
    return (f"DeepSpeed-Ulysses over {n} GPUs, {s:,} tokens, hidden 4096 with 8 KV heads of 128 "
            "(kv 1024), bf16: GB each GPU sends in one layer's forward (both all-to-alls)?",
            theory.ulysses_bytes(s, 4096, n, 2, kv_hidden=1024)["forward"] / 1e9,
            "(N-1)/N of each rank's S/N tokens of q, k, v, then of the output: falls as 1/N.")


def _sp_activation_saving(rng):
    t, s = rng.choice([2, 4, 8]), rng.choice([2048, 4096])
    tp = theory.tp_activation_bytes_per_layer(s, 1, 12288, 96, t)
    sp = theory.sp_activation_bytes_per_layer(s, 1, 12288, 96, t)
    return (f"GPT-3 layer (h 12288, 96 heads), sequence {s}, micro-batch 1, tensor parallel "
            f"{t}: MB of activations per layer per GPU that sequence parallelism saves?",
            (tp - sp) / 1e6, "sbh (10 + 24/t + 5as/(ht)) - sbh/t (34 + 5as/h) = 10 sbh (1 - 1/t).")


def _causal_imbalance(rng):
    n = rng.choice([2, 4, 8, 16])
    flops = [theory.ring_attention_flops(1024 * n, n, r, "contiguous") for r in range(n)]
    return (f"Causal ring attention, contiguous split over {n} GPUs, diagonal blocks computed "
            "whole: the busiest GPU's attention work over the average's?",
            max(flops) / (sum(flops) / n), "Rank r computes r + 1 blocks: 2N/(N+1).")


def _zigzag_speedup(rng):
    n = rng.choice([2, 4, 8, 16])
    seq = 1024 * n
    return (f"Causal ring attention over {n} GPUs, {seq:,} tokens, with a FlashAttention-style "
            "kernel that skips the masked half of a diagonal block: how many times shorter is "
            "the ring's critical path (the busiest GPU of each step, summed) with the zig-zag "
            "split than with the contiguous one?",
            theory.ring_critical_path(seq, n, "contiguous")
            / theory.ring_critical_path(seq, n, "zigzag"),
            "In blocks of side S/2N: contiguous N-1 full blocks (4 each) and a half diagonal, "
            "4N-2; zig-zag 2 per step, 2N: 2 - 1/N. Counting diagonal blocks whole (as the "
            "engine computes them) gives 4N/(2N+1) instead (chapter 09, \"The causal "
            "imbalance, and zig-zag\").")


# -- every topic at least 15 items ---------------------------------------------------------------

def _reduce_scatter_bytes(rng):
    n, m = rng.choice([2, 4, 8, 16, 64]), rng.choice([64, 256, 1000])
    return (f"Ring reduce-scatter of a {m} MB gradient over {n} GPUs: how many MB does each GPU "
            "send?", theory.ring_reduce_scatter_bytes(m, n),
            "(N-1)/N x M: N-1 steps of one M/N chunk, half of an all-reduce; each GPU ends with "
            "the sum of its own 1/N.")


def _all_to_all_bytes(rng):
    n, m = rng.choice([2, 4, 8, 16]), rng.choice([32, 128, 512])
    return (f"All-to-all on {n} GPUs, each holding {m} MB split evenly by destination: how many "
            "MB does each GPU send?", theory.all_to_all_bytes(m, n),
            "(N-1)/N x M: a GPU keeps the piece addressed to itself and sends every other piece "
            "once.")


def _tree_root_bytes(rng):
    n, m = rng.choice([4, 8, 16, 64]), rng.choice([1, 4, 16])
    sent, _ = theory.tree_all_reduce_bytes(m, n, rank=0)
    return (f"Binomial-tree all-reduce of a {m} MB tensor over {n} GPUs (reduce up the tree, "
            "broadcast back down): how many MB does the root, rank 0, send?", sent,
            "The root has log2 N children and sends each the whole result: log2 N x M, more than "
            "a ring GPU's 2(N-1)/N x M. Trees save rounds, not bytes.")


def _dp_step_bytes(rng):
    params, n = rng.choice([25e6, 125e6, 350e6]), rng.choice([4, 8, 32])
    return (f"DDP on {n} GPUs, {params / 1e6:g} M parameters, fp32 gradients, no accumulation: "
            "MB each GPU sends per optimizer step?",
            theory.ring_all_reduce_bytes(4 * params, n) / 1e6,
            "2(N-1)/N x 4P bytes whatever the buckets: buckets decide when the bytes go, not how "
            "many.")


def _dp_throughput(rng):
    micro, compute, n = rng.choice([16, 32]), rng.choice([0.1, 0.25]), rng.choice([8, 32, 128])
    params = rng.choice([100e6, 350e6])
    comm = theory.alpha_beta_time("ring", 4 * params, n, 1e-5, 1 / 25e9)
    return (f"{n} GPUs, {micro} samples per GPU per step, {compute} s of compute per step, "
            f"{params / 1e6:g} M fp32 gradients in one ring all-reduce (alpha 10 us, 25 GB/s), no "
            "overlap: samples per second for the whole job?", n * micro / (compute + comm),
            "N x batch / (compute + 2(N-1) alpha + 2(N-1)/N x 4P / bandwidth).")


def _dp_fp32_states(rng):
    params, n = rng.choice([1.3e9, 3e9, 7e9]), rng.choice([4, 8, 64])
    states = theory.zero_model_state_bytes(params, n, 0, k=8, param_bytes=4, grad_bytes=4)
    return (f"DDP on {n} GPUs, {params / 1e9:g} B parameters, plain fp32 Adam (fp32 weights, "
            "gradients and two moments): GB of model states on each GPU?", states["total"] / GB,
            "4 + 4 + 8 = 16 bytes per parameter on every GPU, whatever N: data parallelism "
            "replicates all of it, and ZeRO is what shards it.")


def _bf16_ring_bytes(rng):
    params, n = rng.choice([110e6, 350e6, 1.3e9]), rng.choice([4, 8, 16])
    return (f"{params / 1e6:g} M gradients all-reduced in bf16 over {n} GPUs by ring: MB each GPU "
            "sends?", theory.ring_all_reduce_bytes(2 * params, n) / 1e6,
            "2(N-1)/N x 2 bytes x P: half of fp32's traffic.")


def _topk_kept(rng):
    numel, ratio = rng.choice([1_000_000, 4_194_304, 25_557_032]), rng.choice([0.001, 0.003, 0.01])
    return (f"Top-K at ratio {ratio} of a bucket of {numel:,} gradient elements: how many "
            "coordinates does each GPU keep and send?", float(theory.topk_kept(numel, ratio)),
            "ceil(ratio x numel), at least one; each is sent with its index.")


def _topk_largest_n(rng):
    ratio, numel = rng.choice([0.003, 0.007, 0.015, 0.03, 0.06]), 1_000_000
    n = 2
    while theory.topk_bytes_per_rank(numel, ratio, n + 1) < \
            theory.ring_all_reduce_bytes(4 * numel, n + 1):
        n += 1
    return (f"Top-K at ratio {ratio} of a 1 M-element gradient (fp32 values and int32 indices, "
            "exchanged by all-gather): the largest number of GPUs at which each GPU still sends "
            "fewer bytes than in a dense fp32 ring all-reduce?", float(n),
            "Top-K sends (N-1) x k x 8 bytes, the ring 2(N-1)/N x 4 numel: fewer while "
            "N x k < numel, that is N < 1/ratio.")


def _powersgd_layer(rng):
    h, r = rng.choice([768, 1024, 2048]), rng.choice([1, 2, 4, 8])
    shapes = [(3 * h, h), (3 * h,), (h, h), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,),
              (h,), (h,), (h,), (h,)]
    before, after = theory.powersgd_elements(shapes, r)
    return (f"PowerSGD rank {r} on one transformer layer of hidden {h}: weight matrices {3 * h} x "
            f"{h}, {h} x {h}, {4 * h} x {h} and {h} x {4 * h}, plus {13 * h:,} bias and LayerNorm "
            "elements sent uncompressed. Compression factor of the layer's gradient?",
            before / after,
            "Each n x m matrix sends (n + m) r; vectors go whole, and at low rank they are a "
            "visible share of what is left.")


def _zero3_layer_bytes(rng):
    h, n = rng.choice([4096, 8192, 12288]), rng.choice([8, 16, 64])
    return (f"ZeRO-3 over {n} GPUs, one transformer layer of hidden {h} (12h^2 parameters) in "
            "bf16, one micro-batch per step: MB each GPU sends for that layer per step?",
            theory.zero_comm_elements(12 * h * h, n, 3) * 2 / 1e6,
            "All-gather for forward, all-gather again for backward, reduce-scatter the gradients: "
            "3(N-1)/N x 12h^2 x 2 bytes, 1.5x what DDP sends.")


def _zero_stage_fit(rng):
    psi, n, memory = rng.choice([(7e9, 8, 80), (13e9, 8, 80), (7e9, 4, 40), (13e9, 16, 40),
                                 (30e9, 16, 80), (13e9, 64, 24), (70e9, 64, 80)])
    stage = next(s for s in (0, 1, 2, 3)
                 if theory.zero_model_state_bytes(psi, n, s)["total"] <= memory * GB)
    return (f"{psi / 1e9:g} B parameters, mixed-precision Adam, {n} GPUs with {memory} GB each: "
            "the lowest ZeRO stage (0, 1, 2 or 3) whose model states fit, ignoring activations?",
            float(stage),
            "Bytes per parameter on each GPU: 2 + 2 + 12 at stage 0, 2 + 2 + 12/N at stage 1, "
            "2 + 14/N at stage 2, 16/N at stage 3.")


def _tp_over_zero3(rng):
    b, s = rng.choice([1, 4, 8]), rng.choice([1024, 2048, 4096])
    h, t = rng.choice([4096, 8192]), rng.choice([2, 4, 8])
    return (f"One transformer layer, micro-batch {b}, sequence {s}, hidden {h}, {t} GPUs, one "
            "micro-batch per step: what tensor parallelism sends per GPU, as a multiple of what "
            "ZeRO-3 sends?", theory.tp_comm_elements_per_layer(b, s, h, t)
            / theory.zero3_comm_elements_per_layer(h, t),
            "8bsh(t-1)/t over 3(t-1)/t x (12h^2 + 13h), about 2bs/(9h): TP's grows with the "
            "tokens, ZeRO-3's with the parameters; equal near 4.5h tokens.")


def _tp_all_reduce_ms(rng):
    b, s, t = rng.choice([1, 2, 4]), rng.choice([2048, 4096]), rng.choice([4, 8])
    h, bandwidth = rng.choice([8192, 12288]), rng.choice([150, 300])
    seconds = theory.tp_comm_elements_per_layer(b, s, h, t) * 2 / (bandwidth * 1e9)
    return (f"Megatron TP {t}, micro-batch {b}, sequence {s}, hidden {h}, bf16, each GPU sending "
            f"at {bandwidth} GB/s: ms per layer spent in the TP all-reduces, forward and backward, "
            "bandwidth term only?", seconds * 1e3,
            "8bsh(t-1)/t elements x 2 bytes / bandwidth, on the critical path every layer; at the "
            "25 GB/s of a fast network it would take 6-12x longer: TP stays on NVLink.")


def _gpus_for_days(rng):
    params, tokens = rng.choice([(13e9, 1e12), (70e9, 2e12), (175e9, 300e9)])
    days, rate = rng.choice([30, 60, 90]), rng.choice([120e12, 150e12])
    return (f"{params / 1e9:g} B parameters, {tokens / 1e9:g} B tokens, each GPU sustaining "
            f"{rate / 1e12:g} TFLOP/s with activation recomputation: how many GPUs finish in "
            f"{days} days?", theory.training_days(tokens, params, 1, rate) / days,
            "8 T P / (n X) seconds = the days asked: n = 8 T P / (X x days x 86400).")


def _training_compute(rng):
    params, tokens = rng.choice([7e9, 70e9, 175e9]), rng.choice([300e9, 1e12, 2e12])
    return (f"{params / 1e9:g} B parameters trained on {tokens / 1e9:g} B tokens, without "
            "recomputation: total training compute in exaFLOPs?",
            theory.training_days(tokens, params, 1, 1.0, recompute=False) * 86400 / 1e18,
            "6 T P: per parameter and token 2 FLOPs forward and 4 backward; with P = 12 l h^2 "
            "it is the leading term of Megatron's 72 B s l h^2 (...).")


def _mfu(rng):
    batch, n, rate = rng.choice([512, 1536]), rng.choice([1024, 3072]), \
        rng.choice([120e12, 140e12, 160e12])
    seconds = round(theory.transformer_flops(batch, 2048, 96, 12288) / (n * rate), 1)
    return (f"GPT-3 (96 layers, h 12288, V 51200): a step of {batch} sequences of 2048 tokens "
            f"with full recomputation takes {seconds:g} s on {n} A100s (peak 312 TFLOP/s). Model "
            "FLOPs utilisation, in percent?",
            100 * theory.transformer_flops(batch, 2048, 96, 12288, recompute=False)
            / (seconds * n * 312e12),
            "MFU counts the model's FLOPs only, 72 B s l h^2(...) with no recomputed forward, over "
            "time x GPUs x peak: 3/4 of the hardware utilisation here.")


def _checkpointed_activations(rng):
    layers, h = rng.choice([(32, 4096), (80, 8192), (96, 12288)])
    s, b = rng.choice([2048, 8192]), rng.choice([1, 4])
    return (f"Full activation checkpointing, {layers} layers, hidden {h}, sequence {s}, "
            f"micro-batch {b}, 16-bit activations, no tensor parallelism: GB kept between forward "
            "and backward for all layers?",
            theory.transformer_activation_bytes(layers, h, 32, s, b, checkpoint=True) / 1e9,
            "Only each layer's input, 2 s b h bytes per layer; the rest is recomputed in backward, "
            "one more forward.")


def _moe_dispatch_one(rng):
    n, t = rng.choice([4, 8, 16, 64]), rng.choice([4096, 8192])
    h, k = rng.choice([2048, 4096, 7168]), rng.choice([1, 2, 6, 8])
    return (f"Expert parallelism over {n} GPUs, {t} tokens per GPU, hidden {h}, top-{k}, bf16, "
            "uniform routing, nothing dropped: MB each GPU sends in the dispatch all-to-all "
            "alone?", theory.moe_all_to_all_bytes(t, h, k, n, 2)["dispatch"] / 1e6,
            "(n-1)/n x T k h x 2 bytes: a token goes out once per chosen expert, and the 1/n of "
            "rows for local experts stays.")


def _moe_total_params(rng):
    layers, e, k = rng.choice([32, 56]), rng.choice([8, 16, 64]), rng.choice([1, 2])
    p = theory.moe_params(layers, 4096, 14336, e, k, 32000, kv_hidden=1024)
    return (f"A Mixtral-shaped decoder (h 4096, SwiGLU experts of 14336, 8 kv heads of 128, vocab "
            f"32000, untied embeddings) with {layers} layers, {e} experts, top-{k}: billions of "
            "parameters in all, what memory must hold?", p["total"] / 1e9,
            "Every expert of every layer (3 h f each), plus the shared attention, routers, norms "
            "and both embeddings; k changes what a token uses, not what is stored.")


def _moe_flops_fraction(rng):
    layers, e, k = rng.choice([32, 56]), rng.choice([8, 16, 64]), rng.choice([1, 2])
    s = rng.choice([2048, 4096, 32768])
    sparse = theory.moe_forward_flops_per_token(layers, 4096, 14336, e, k, s, kv_hidden=1024)
    dense = theory.moe_forward_flops_per_token(layers, 4096, 14336, e, e, s, kv_hidden=1024)
    return (f"Mixtral-shaped layers (h 4096, SwiGLU experts of 14336, kv 1024), {layers} layers, "
            f"{e} experts, top-{k}, sequence {s}: a token's forward FLOPs as a fraction of those "
            f"of the dense model with the same parameters (all {e} experts run)?", sparse / dense,
            "2 N_active + 2 l s h over 2 N_total + 2 l s h (Kaplan et al.): the parameters a token "
            "uses set its FLOPs; attention's share grows with the sequence.")


def _moe_dropped(rng):
    t, e, k = rng.choice([1024, 4096]), rng.choice([8, 16]), rng.choice([1, 2])
    cf, share = rng.choice([1.0, 1.25, 1.5]), rng.choice([0.25, 0.375, 0.5])
    capacity = theory.expert_capacity(t, e, k, cf)
    return (f"{t} tokens on a GPU, {e} experts, top-{k}, capacity factor {cf}; a skewed router "
            f"sends {share:.1%} of the {t * k} (token, expert) assignments to expert 0. How many "
            "of them does expert 0 drop?", share * t * k - capacity,
            "Capacity ceil(T k cf / E) slots; what arrives beyond them is dropped, and a token "
            "with every choice dropped rides the residual.")


def _ring_over_ulysses(rng):
    n, s = rng.choice([2, 4, 8]), rng.choice([32768, 131072])
    h, kv = rng.choice([(4096, 4096), (4096, 1024), (8192, 1024)])
    ring = theory.ring_attention_bytes(s, kv, n)["forward"]
    return (f"{s:,} tokens over {n} GPUs, hidden {h}, K/V width {kv}, bf16, one layer's "
            "forward: ring attention's bytes per GPU as a multiple of Ulysses'?",
            ring / theory.ulysses_bytes(s, h, n, kv_hidden=kv)["forward"],
            "2(N-1)(S/N) kv over (N-1)/N^2 x S (2h + 2kv) = N kv / (h + kv): N/2 without grouped "
            "KV heads, and less with them.")


def _sp_comm(rng):
    b, s = rng.choice([1, 2]), rng.choice([4096, 8192])
    h, t = rng.choice([4096, 8192]), rng.choice([2, 4, 8])
    return (f"Megatron tensor + sequence parallelism of degree {t}, micro-batch {b}, sequence "
            f"{s}, hidden {h}: million elements each GPU sends per layer, forward and backward?",
            theory.sp_comm_elements_per_layer(b, s, h, t) / 1e6,
            "Each of TP's four all-reduces becomes a reduce-scatter and an all-gather (the same "
            "8bsh(t-1)/t), and backward re-gathers the input of each column-parallel layer: "
            "10bsh(t-1)/t.")


def _long_context_activations(rng):
    s, h, a = rng.choice([8192, 32768, 131072]), 4096, 32
    return (f"One layer of LLaMA-7B's shape (h {h}, {a} heads), one sequence of {s:,} tokens, "
            "16-bit, attention scores stored (no FlashAttention), no parallelism: GB of "
            "activations kept for backward?",
            theory.transformer_activation_bytes(1, h, a, s) / 1e9,
            "s b h (34 + 5 a s / h): the 5 a s^2 b scores grow with s^2 and dominate; without them "
            "34 sbh is left, linear in s.")


NUMERIC = [
    Numeric("ring-bytes", "collectives", _ring_bytes, unit="MB",
            zh="数据并行中，梯度同步的通信量具体是多少？"),
    Numeric("ps-server-bytes", "collectives", _ps_server, unit="MB",
            zh="Ring AllReduce和参数服务器模式有什么区别？"),
    Numeric("ps-over-ring", "collectives", _ps_over_ring, unit="x"),
    Numeric("flat-broadcast-root", "collectives", _flat_broadcast, unit="MB"),
    Numeric("ring-rounds", "collectives", _ring_rounds, unit="rounds"),
    Numeric("tree-rounds", "collectives", _tree_rounds, unit="rounds"),
    Numeric("alpha-beta-time", "collectives", _alpha_beta, unit="ms"),
    Numeric("bus-bandwidth", "collectives", _busbw, unit="GB/s"),
    Numeric("accumulation-all-reduces", "data parallel", _grad_accum, unit="all-reduces"),
    Numeric("effective-batch", "data parallel", _effective_batch, unit="samples"),
    Numeric("scaling-efficiency", "data parallel", _amdahl, unit="%"),
    Numeric("gradient-megabytes", "data parallel", _grad_mb, unit="MB"),
    Numeric("topk-bytes", "compression", _topk_bytes, unit="MB",
            zh="梯度压缩（如Top-K稀疏化）如何影响收敛？如何选择压缩率？"),
    Numeric("topk-fraction", "compression", _topk_fraction, unit="%"),
    Numeric("topk-breakeven", "compression", _topk_breakeven, unit="fraction"),
    Numeric("powersgd-elements", "compression", _powersgd_elements, unit="elements"),
    Numeric("powersgd-ratio", "compression", _powersgd_ratio, unit="x"),
    Numeric("fp16-savings", "compression", _fp16_bytes, unit="MB"),
    Numeric("zero-bytes", "zero", _zero_bytes, unit="GB"),
    Numeric("zero-saving", "zero", _zero_saving, unit="x"),
    Numeric("zero-comm", "zero", _zero_comm, unit="x",
            zh="ZeRO-2 和 ZeRO-3 在通信上的具体差异是什么？"),
    Numeric("plain-dp-states", "zero", _plain_dp_states, unit="TB"),
    Numeric("offload-pcie", "zero", _offload, unit="GB"),
    Numeric("tp-elements", "tensor parallel", _tp_elements, unit="million"),
    Numeric("tp-all-reduces", "tensor parallel", _tp_allreduces, unit="all-reduces"),
    Numeric("layer-params", "tensor parallel", _layer_params, unit="billion"),
    Numeric("tp-activations", "tensor parallel", _activations, unit="MB"),
    Numeric("tp-zero3-crossover", "tensor parallel", _crossover, unit="tokens",
            zh="ZeRO-3 和模型并行（张量并行）有什么区别？什么时候该用哪个？"),
    Numeric("bubble-total", "pipeline", _bubble_total, unit="fraction"),
    Numeric("bubble-ideal", "pipeline", _bubble_ideal, unit="fraction"),
    Numeric("bubble-interleaved", "pipeline", _bubble_interleaved, unit="fraction"),
    Numeric("choose-m", "pipeline", _choose_m, unit="micro-batches",
            zh="流水线并行中，如何选择stage数量和微批次大小？"),
    Numeric("inflight-1f1b", "pipeline", _inflight_1f1b, unit="micro-batches"),
    Numeric("inflight-gpipe", "pipeline", _inflight_gpipe, unit="micro-batches"),
    Numeric("zb-h1-bubble", "pipeline", _zb_h1_bubble, unit="fraction"),
    Numeric("zb-h1-readme-formula", "pipeline", _zb_h1_readme, unit="units of F"),
    Numeric("zb-h1-over-1f1b", "pipeline", _zb_h1_over_1f1b, unit="fraction"),
    Numeric("transformer-params", "3d and scale", _params, unit="billion"),
    Numeric("training-days", "3d and scale", _days, unit="days"),
    Numeric("step-flops", "3d and scale", _flops, unit="EFLOP"),
    Numeric("global-batch", "3d and scale", _global_batch, unit="sequences"),
    Numeric("states-3d", "3d and scale", _states_3d, unit="GB"),
    Numeric("moe-capacity", "moe", _moe_capacity, unit="slots"),
    Numeric("moe-all-to-all-bytes", "moe", _moe_dispatch_bytes, unit="MB"),
    Numeric("moe-active-params", "moe", _moe_active, unit="billion"),
    Numeric("ring-attention-bytes", "long context", _ring_attention_gb, unit="GB"),
    Numeric("ulysses-bytes", "long context", _ulysses_gb, unit="GB"),
    Numeric("sp-activation-saving", "long context", _sp_activation_saving, unit="MB"),
    Numeric("causal-imbalance", "long context", _causal_imbalance, unit="x"),
    Numeric("zigzag-speedup", "long context", _zigzag_speedup, unit="x"),
    Numeric("reduce-scatter-bytes", "collectives", _reduce_scatter_bytes, unit="MB"),
    Numeric("all-to-all-bytes", "collectives", _all_to_all_bytes, unit="MB"),
    Numeric("tree-root-bytes", "collectives", _tree_root_bytes, unit="MB"),
    Numeric("dp-step-bytes", "data parallel", _dp_step_bytes, unit="MB"),
    Numeric("dp-throughput", "data parallel", _dp_throughput, unit="samples/s"),
    Numeric("dp-fp32-states", "data parallel", _dp_fp32_states, unit="GB"),
    Numeric("bf16-ring-bytes", "compression", _bf16_ring_bytes, unit="MB"),
    Numeric("topk-kept", "compression", _topk_kept, unit="coordinates"),
    Numeric("topk-largest-n", "compression", _topk_largest_n, unit="GPUs"),
    Numeric("powersgd-layer", "compression", _powersgd_layer, unit="x"),
    Numeric("zero3-layer-bytes", "zero", _zero3_layer_bytes, unit="MB"),
    Numeric("zero-stage-fit", "zero", _zero_stage_fit, unit="stage"),
    Numeric("tp-over-zero3", "tensor parallel", _tp_over_zero3, unit="x"),
    Numeric("tp-all-reduce-ms", "tensor parallel", _tp_all_reduce_ms, unit="ms"),
    Numeric("gpus-for-days", "3d and scale", _gpus_for_days, unit="GPUs"),
    Numeric("training-compute", "3d and scale", _training_compute, unit="EFLOP"),
    Numeric("mfu", "3d and scale", _mfu, unit="%"),
    Numeric("checkpointed-activations", "3d and scale", _checkpointed_activations, unit="GB"),
    Numeric("moe-dispatch-bytes", "moe", _moe_dispatch_one, unit="MB"),
    Numeric("moe-total-params", "moe", _moe_total_params, unit="billion"),
    Numeric("moe-flops-fraction", "moe", _moe_flops_fraction, unit="fraction"),
    Numeric("moe-dropped", "moe", _moe_dropped, unit="assignments"),
    Numeric("ring-over-ulysses", "long context", _ring_over_ulysses, unit="x"),
    Numeric("sp-comm-elements", "long context", _sp_comm, unit="million"),
    Numeric("long-context-activations", "long context", _long_context_activations, unit="GB"),
]
