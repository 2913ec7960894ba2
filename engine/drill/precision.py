"""Precision and memory items (chapter 12): mixed precision and loss scaling, FSDP2, FP8 scaling, activation checkpointing, Muon.

Answers are computed by :mod:`engine.theory` (numeric items) or settled by a measurement in
the chapter (choice items); every item names the chapter section that teaches it.
"""

from __future__ import annotations

from engine import theory
from engine.drill.items import Choice, Numeric, Outline

C12 = "course/12_precision_memory.ipynb"
TOPIC = "precision and memory"
BYTES_TABLE, UNDERFLOW, SCALER = ("Where each tensor lives: bytes per parameter",
                                  "fp16 underflows, the loss scaler rescues it",
                                  "The scaler decides as GradScaler does")
FSDP2, FP8, FP8_LM = ("FSDP2: one shard per parameter, on dim 0", "FP8: who shares a scale",
                      "An FP8 language model, and an FP8 all-gather")
MUON, CHECKPOINTING = "Muon: why it does not shard like Adam", "Activation checkpointing"


# -- numeric: every answer from engine.theory at drawn parameters -----------------------------

def _bytes_per_parameter(rng):
    billions = rng.choice([1, 7, 13, 70])
    low, name = rng.choice([(2, "bf16"), (2, "fp16")])
    per = theory.mixed_precision_bytes_per_parameter(low, master_gradient=False)
    return (f"A {billions}B-parameter model trained with {name} mixed precision and Adam "
            "(fp32 master weights and moments; the optimizer reads the 16-bit gradient): GB of "
            "model state on one GPU without sharding?", billions * per,
            "2 (16-bit weights) + 2 (16-bit gradients) + 4 (fp32 master) + 8 (Adam's two fp32 "
            "moments) = 16 bytes per parameter; an fp32 master gradient adds 4 more.")


def _bytes_with_master_gradient(rng):
    name = rng.choice(["bf16", "fp16"])
    optimizer, state = rng.choice([("Adam's two fp32 moments", 8),
                                   ("SGD's fp32 momentum", 4)])
    return (f"Mixed precision with a {name} working copy of the weights and its gradient, an "
            f"fp32 master, an fp32 master gradient and {optimizer}: bytes per parameter?",
            theory.mixed_precision_bytes_per_parameter(2, master_gradient=True,
                                                       optimizer_bytes=state),
            "4 (master) + 2 + 2 (the 16-bit copy and its gradient) + 4 (master gradient) + the "
            "optimizer's fp32 state (8 for Adam's two moments, 4 for a momentum): the 16-bit "
            "format shrinks only the two working tensors.")


def _scale_after(rng):
    interval = rng.choice([3, 4, 5])
    clean = rng.choice([7, 9, 11, 13])
    overflows = rng.choice([1, 2, 3])
    flags = [True] * overflows + [False] * clean
    scale, _, _ = theory.loss_scale_after(flags, 2.0**16, 2.0, 0.5, interval)
    return (f"A dynamic loss scaler starts at 2^16 = 65536 (growth 2, back-off 0.5, growth "
            f"interval {interval}). The first {overflows} step(s) overflow, then {clean} clean "
            "steps follow. The scale after them?", scale,
            "Each overflow halves the scale (and skips the step); every growth_interval clean "
            "steps in a row double it.")


def _padding_rows(rng):
    rows, n = rng.choice([(50257, 8), (32000, 3), (11008, 12), (4097, 4), (100, 16)])
    return (f"FSDP2 shards a parameter of {rows} rows on dim 0 over {n} ranks: how many rows "
            "of zeros pad the collectives?", theory.dim0_padding_rows(rows, n),
            "Every chunk has ceil(rows / n) rows so that the all-gather sees equal chunks: "
            "ceil(rows / n) x n - rows rows of padding travel, none is kept in the shard.")


def _fp8_all_gather(rng):
    millions, n = rng.choice([4, 16, 64]), rng.choice([2, 4, 8])
    shard = millions * 10**6 // n
    return (f"A {millions} M-element parameter sharded over {n} ranks is all-gathered in FP8, "
            "each shard cast with its own fp32 scale and the scales gathered beside it (the "
            "chapter's per-shard variant): MB each rank sends?",
            theory.fp8_all_gather_bytes(shard, n) / 1e6,
            "(n-1) x (shard elements x 1 byte + 4 bytes of scale): half of bf16's "
            "(n-1) x 2 x shard, plus the scales. torchao keeps one scale per weight instead: "
            "an all-reduce of the amax before the cast, no scales gathered.", )


def _fp8_over_bf16(rng):
    shard, n = rng.choice([1000, 4096, 250_000]), rng.choice([2, 4, 8])
    return (f"A shard of {shard:,} elements, all-gathered over {n} ranks: FP8 (each shard with "
            "its own fp32 scale, gathered beside it) bytes as a fraction of bf16's?",
            theory.fp8_all_gather_bytes(shard, n) / theory.fp8_all_gather_bytes(shard, n, 2, 0),
            "1 byte against 2 per element, and 4 bytes of scale per rank: just over one half.")


def _scale_count(rng):
    m, k, n = rng.choice([1024, 4096]), rng.choice([4096, 7168]), rng.choice([4096, 18432])
    return (f"DeepSeek-V3's FP8 scaling: an activation of {m} x {k} in 1 x 128 tiles and a "
            f"weight of {k} x {n} in 128 x 128 blocks. How many fp32 scales?",
            theory.fp8_scale_count(m, k, n),
            "M K / 128 for the activation tiles plus (K / 128)(N / 128) for the weight blocks.")


def _ns_flops(rng):
    rows, cols = rng.choice([(4096, 4096), (4096, 11008), (11008, 4096), (1024, 4096)])
    return (f"Muon's 5 quintic Newton-Schulz steps on a {rows} x {cols} momentum matrix, the "
            "smaller Gram matrix formed: how many billion FLOPs?",
            theory.muon_newton_schulz_flops(rows, cols) / 1e9,
            "m = min, n = max: each step X X^T (2 m^2 n), its square (2 m^3), the product with X "
            "(2 m^2 n); five steps.")


def _ns_over_forward(rng):
    h, tokens = rng.choice([1024, 4096, 8192]), rng.choice([2**19, 2**21])
    return (f"A {h} x {h} weight matrix, a batch of {tokens:,} tokens: Muon's Newton-Schulz "
            "FLOPs as a percent of the matrix's training FLOPs (6 x tokens x h^2)?",
            100 * theory.muon_newton_schulz_flops(h, h) / (6 * tokens * h * h),
            "5 x 6 h^3 against 6 T h^2: 5h/T, small for large batches (Jordan 2024 puts it "
            "under 1% in typical LM training).")


def _activations_none(rng):
    s, h, a = rng.choice([2048, 4096]), rng.choice([4096, 8192]), rng.choice([32, 64])
    return (f"One transformer layer, sequence {s}, micro-batch 1, hidden {h}, {a} heads, "
            "16-bit, no recomputation, no parallelism: GB of activations kept for backward?",
            theory.recompute_activation_bytes_per_layer(s, 1, h, a, "none") / 1e9,
            "Korthikanti et al.: 34 s b h + 5 a s^2 b bytes per layer.")


def _selective_saving(rng):
    s, h, a = rng.choice([2048, 4096, 8192]), rng.choice([4096, 8192]), rng.choice([32, 64])
    none = theory.recompute_activation_bytes_per_layer(s, 1, h, a, "none")
    selective = theory.recompute_activation_bytes_per_layer(s, 1, h, a, "selective")
    return (f"Sequence {s}, hidden {h}, {a} heads: what percent of a layer's activation "
            "memory does selective recomputation (recompute only the attention core) save?",
            100 * (none - selective) / none,
            "It drops the 5 a s^2 b kept by the attention core (Q K^T, softmax, its dropout, "
            "the product with V): 5as/h / (34 + 5as/h) of the total, for a few percent more "
            "FLOPs.")


def _none_over_full(rng):
    s, h, a = rng.choice([2048, 4096, 8192]), rng.choice([4096, 8192]), rng.choice([32, 64])
    t = rng.choice([1, 8])
    ratio = (theory.recompute_activation_bytes_per_layer(s, 1, h, a, "none", t)
             / theory.recompute_activation_bytes_per_layer(s, 1, h, a, "full", t))
    return ("Take full recomputation to keep each rank's sequence shard of the layer's "
            "input, 2 s b h / t (Megatron-LM with sequence parallelism; Korthikanti et al.'s "
            f"Table 2 lists 2 s b h). Sequence {s}, hidden {h}, {a} heads, tensor + sequence "
            f"parallelism {t}: a layer without recomputation keeps how many times the "
            "activations of full recomputation?", ratio,
            "(34 s b h + 5 a s^2 b) / t against 2 s b h / t: 17 + 2.5 a s / h. Selective "
            "recomputation keeps 34 s b h / t, 17x full's, for far fewer FLOPs recomputed. "
            "With the input kept whole (Table 2's 2 s b h), the ratio divides by t.")


NUMERIC = [
    Numeric("mp-bytes-per-parameter", TOPIC, _bytes_per_parameter, unit="GB"),
    Numeric("mp-bytes-master-gradient", TOPIC, _bytes_with_master_gradient, unit="B"),
    Numeric("loss-scale-after", TOPIC, _scale_after, unit="scale"),
    Numeric("fsdp2-padding-rows", TOPIC, _padding_rows, unit="rows"),
    Numeric("fp8-all-gather-bytes", TOPIC, _fp8_all_gather, unit="MB"),
    Numeric("fp8-over-bf16-gather", TOPIC, _fp8_over_bf16, unit="fraction"),
    Numeric("fp8-scale-count", TOPIC, _scale_count, unit="scales"),
    Numeric("muon-ns-flops", TOPIC, _ns_flops, unit="billion"),
    Numeric("muon-ns-share", TOPIC, _ns_over_forward, unit="%"),
    Numeric("activations-no-recompute", TOPIC, _activations_none, unit="GB"),
    Numeric("selective-recompute-saving", TOPIC, _selective_saving, unit="%"),
    Numeric("no-recompute-over-full", TOPIC, _none_over_full, unit="x"),
]

# -- choice: settled by the chapter's measurements ---------------------------------------------

CHOICE = [
    Choice("bf16-loss-scaling", TOPIC,
           "Does bf16 training need loss scaling, as fp16 does?",
           ("No: bf16 has fp32's 8 exponent bits, so small gradients do not underflow",
            "Yes: it has fewer mantissa bits than fp16, so it underflows sooner",
            "Yes, but only for the optimizer's moments"), 0,
           "Measured: the MLP's fp16 backward flushes 470 of its 16,640 non-zero gradient "
           "elements (2.8%) to zero, bf16's none; fp16 needs the scaler for its 5 exponent "
           "bits, not for precision.",
           (C12, UNDERFLOW)),
    Choice("what-stays-fp32", TOPIC,
           "In bf16 mixed-precision training with Adam, what stays in fp32?",
           ("The master weights and the optimizer's moments (and the update that applies them)",
            "Nothing: everything is bf16 to halve the memory",
            "Only the loss"), 0,
           "A bf16 weight rounds away an update smaller than about 2^-9 of itself; the masters "
           "and Adam's moments stay fp32, the forward and backward run on the bf16 copy.",
           (C12, BYTES_TABLE)),
    Choice("scaler-on-overflow", TOPIC,
           "A step's scaled gradients contain an inf. What does a dynamic loss scaler do?",
           ("Skips the optimizer step, multiplies the scale by the back-off (0.5), restarts "
            "its count of clean steps",
            "Clips the gradients and steps anyway",
            "Steps, then halves the scale for the next step"), 0,
           "Our scaler and torch.amp.GradScaler skip the same steps and reach the same scales, "
           "measured on one gradient sequence.", (C12, SCALER)),
    Choice("fp8-tile-vs-tensor", TOPIC,
           "Activations with an outlier channel and tokens of very different norms, cast to "
           "FP8 (E4M3): what does one scale for the whole tensor cost, against one scale per "
           "token (row) or per 1 x 128 tile, under the same weight scaling?",
           ("Several times the error: the largest values set the one scale and the small "
            "tokens fall into subnormals or to zero; per-row and 1 x 128 tiles lose about the "
            "same",
            "Nothing: FP8's exponent covers the range",
            "Less error: the fewest scales, the least rounding"), 0,
           "Measured on the outlier input under 128 x 128 weight blocks: mean per-token error "
           "0.0972 per tensor, 0.0299 per row, 0.0297 per 1 x 128 tile. A 100x outlier still "
           "fits E4M3's range inside a row, so tiles gain little over rows here; DeepSeek-V3's "
           "other reason for 1 x 128 is the hardware: its GEMMs promote partial sums to fp32 "
           "every 128 elements of K, where each group's scale is applied.", (C12, FP8)),
    Choice("fsdp2-vs-fsdp1", TOPIC,
           "What does PyTorch's FSDP2 shard differently from FSDP1?",
           ("Each parameter on dim 0 as its own (DTensor) shard, where FSDP1 flattened a unit's "
            "parameters into one flat parameter",
            "FSDP2 shards activations as well", "FSDP2 shards only the optimizer state"), 0,
           "Per-parameter shards keep names, shapes on dims 1.., dtypes and requires_grad: the "
           "user's optimizer steps them, TP composes, checkpoints need no flat surgery. Measured "
           "beside PyTorch's fully_shard: the same bytes sent on every rank and the same bytes "
           "held but on the last, whose shorter shards PyTorch keeps as views of padded storage "
           "(ours keeps them and their gradients unpadded).", (C12, FSDP2)),
    Choice("muon-naive-shard", TOPIC,
           "Can each ZeRO rank run Muon's Newton-Schulz on its own row shard of a matrix?",
           ("No: orthogonalising the pieces is not the piece of the orthogonalised matrix; the "
            "whole matrix must be gathered, on one owner or on every rank",
            "Yes: Newton-Schulz works row by row",
            "Yes, if the shards are padded to equal size"), 0,
           "Measured: the stacked per-shard results are far from the whole matrix's (relative "
           "error of order one). Distributed Muon either gives each matrix an owner (Keller "
           "Jordan's, Essential AI's) or gathers it on every rank and keeps a slice "
           "(Moonlight's Algorithm 1).", (C12, MUON)),
    Choice("fp8-gather-bytes", TOPIC,
           "What does FSDP send when it gathers its parameters in FP8 instead of bf16?",
           ("About half the bytes: one per element, plus a few bytes of fp32 scale",
            "A quarter of the bytes", "The same bytes: Gloo and NCCL pad FP8 to 16 bits"), 0,
           "Counted on the wire, 1000 elements a shard on 4 ranks: 3,012 B a rank in FP8 with "
           "one scale per shard, 3,004 to 3,008 B with one scale per weight (torchao's: an "
           "amax all-reduce instead of the gathered scales), against bf16's 6,000 B.",
           (C12, FP8_LM)),
]

# -- outline: 30-second answers ------------------------------------------------------------------

OUTLINE = [
    Outline("bf16-fp32-split", TOPIC, "What runs in bf16 and what stays in fp32?",
            ("bf16: the working copy of the weights, activations, matmuls, gradients",
             "fp32: master weights, Adam's moments, the update; reductions and norms, softmax "
             "and loss often in fp32 too",
             "why: a bf16 weight rounds away an update smaller than about 2^-9 of itself",
             "memory: 16-20 bytes per parameter; activations halve"),
            evidence=(C12, BYTES_TABLE)),
    Outline("fp16-loss-scaling", TOPIC, "Why does fp16 need loss scaling, and bf16 not?",
            ("fp16 has 5 exponent bits: values below ~6e-8 flush to zero, small gradients "
             "vanish",
             "multiply the loss by S, gradients scale by S; unscale in fp32 before the step",
             "dynamic: inf/NaN -> skip the step, halve S; N clean steps -> double S",
             "bf16 has fp32's exponent range: no underflow, no scaler"),
            evidence=(C12, UNDERFLOW)),
    Outline("selective-recompute", TOPIC,
            "What does selective activation recomputation save, against full recomputation?",
            ("per layer 34 s b h + 5 a s^2 b bytes without recomputation (Korthikanti et al.)",
             "selective recomputes only the attention core (Q K^T, softmax, its dropout, the "
             "product with V): drops 5 a s^2 b, keeps 34 s b h, costs a few percent FLOPs",
             "full keeps only the layer input (2 s b h) but reruns the whole forward (~33% more)",
             "with TP + SP the 34 s b h and 5 a s^2 b terms divide by t; full's 2 s b h too when, "
             "as in Megatron-LM, each rank keeps its sequence shard of the input"),
            evidence=(C12, CHECKPOINTING)),
    Outline("muon-sharding", TOPIC, "Why does Muon not shard like Adam?",
            ("Adam is elementwise: each rank updates its slice independently",
             "Muon orthogonalises whole matrices (Newton-Schulz on M M^T): a slice's result is "
             "not the slice of the result",
             "owner scheme (Keller Jordan's, Essential AI's): each matrix orthogonalised once, "
             "by its owner, then all-gathered; bytes padded to the busiest owner, NS FLOPs "
             "uneven",
             "Moonlight's Algorithm 1: ZeRO-1's even slices, every matrix gathered and "
             "orthogonalised on every rank (N times the NS FLOPs), each keeping its slice; one "
             "collective more"),
            evidence=(C12, MUON)),
]

ITEMS: list = NUMERIC + CHOICE + OUTLINE  # the items of topic 'precision and memory'
