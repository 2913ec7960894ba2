"""Long-context items (chapter 09): Ulysses past the KV heads, all-gather and 2D context
parallelism, striped layouts, the memory each method holds.

Answers are computed by :mod:`engine.theory` (numeric items) or settled by a measurement in
the chapter (choice items); every item names the chapter section that teaches it.
"""

from __future__ import annotations

from engine import theory
from engine.cp.documents import document_imbalance
from engine.drill.items import Choice, Numeric

C09 = "course/09_long_context.ipynb"
TOPIC = "long context"
PAST_KV = "Ulysses past the KV heads"
WHEN = "Ring or Ulysses: when each wins"
ALLGATHER = "All-gather context parallelism"
TWO_D = "2D attention: Ulysses inside, ring across"
STRIPED = "Striped against zig-zag"
MEMORY = "The memory each method holds"
TORCH = "PyTorch's context_parallel"
DOCUMENTS = "Load balance with document masks"


def _see(section: str) -> str:
    return f" (chapter 09, \"{section}\")"


def _replicated_ulysses_gb(rng):
    n, s = rng.choice([16, 32]), rng.choice([32768, 131072])
    travelling = theory.ulysses_sent_kv_heads(32, 8, n)
    return (f"Ulysses over {n} GPUs on a layer with 32 query heads and 8 KV heads of 128 "
            f"(hidden 4096), {s:,} tokens, bf16: GB each GPU sends in one layer's forward (both "
            "all-to-alls), KV heads replicated as needed?",
            theory.ulysses_bytes(s, 4096, n, 2, travelling * 128)["forward"] / 1e9,
            f"lcm(8, {n}) = {travelling} KV heads travel: (N-1)/N^2 S (2 x 4096 + 2 x "
            f"{travelling * 128}) x 2 B" + _see(PAST_KV) + ".")


def _ulysses_crossover(rng):
    kv = rng.choice([4, 8])
    heads = kv * rng.choice([2, 4, 8])
    beats = [n for n in range(1, heads + 1) if heads % n == 0
             and theory.ulysses_beats_ring(heads, kv, n)]
    return (f"{heads} query heads, {kv} KV heads: the smallest N (dividing {heads}) at which "
            "Ulysses sends fewer bytes per GPU than ring attention?", float(beats[0]),
            f"Ulysses < ring when h_q + h_kv' < N h_kv; with N dividing h_kv that is N > 1 + "
            f"h_q/h_kv = {1 + heads // kv}; past h_kv the replicas count" + _see(WHEN) + ".")


def _allgather_gb(rng):
    n, s = rng.choice([2, 4, 8, 16]), rng.choice([32768, 131072])
    return (f"All-gather context parallelism (Llama 3) over {n} GPUs, {s:,} tokens, 8 KV heads "
            "of 128 (kv 1024), bf16: GB each GPU sends in one layer's forward?",
            theory.allgather_cp_bytes(s, 1024, n, 2)["forward"] / 1e9,
            "(N-1)/N of the whole K and V, 2 S kv x 2 B: the ring's forward bytes, in one "
            "collective" + _see(ALLGATHER) + ".")


def _allgather_memory(rng):
    n, s = rng.choice([4, 8, 16]), rng.choice([131072, 524288])
    gathered = theory.cp_memory_bytes("allgather", s, 32, 8, 128, n, 2)["forward"]
    ring = theory.cp_memory_bytes("ring", s, 32, 8, 128, n, 2)["forward"]
    return (f"{s:,} tokens over {n} GPUs, 8 KV heads of 128, bf16, forward of one layer: the "
            "K/V buffers all-gather CP holds as a multiple of the ring's (two blocks in "
            "flight)?", gathered / ring,
            "All-gather holds the whole 2 S kv; the ring the block in use and the one arriving, "
            "2 x 2 (S/N) kv: N/2" + _see(MEMORY) + ".")


def _ring_backward_memory(rng):
    n, s = rng.choice([4, 8, 16]), rng.choice([131072, 524288])
    return (f"Ring attention over {n} GPUs, {s:,} tokens, 8 KV heads of 128, bf16 inputs, fp32 "
            "accumulation: MB of K/V and dK/dV buffers one GPU holds at the peak of a layer's "
            "backward?",
            theory.cp_memory_bytes("ring", s, 32, 8, 128, n, 2, 4)["backward"] / 1e6,
            "Blocks of 2 (S/N) kv: K/V in use and arriving and the dK/dV accumulator's send and "
            "receive buffers in bf16 (4 x 2 B), this rank's own dK/dV and the step's share in "
            "fp32 (2 x 4 B)" + _see(MEMORY) + ".")


def _usp_gb(rng):
    u, r = rng.choice([(8, 2), (8, 4), (4, 8)])
    s = 131072
    return (f"2D attention (USP): Ulysses over {u} GPUs in a node, ring across {r} nodes "
            f"({u * r} GPUs), {s:,} tokens, 32 query heads and 8 KV heads of 128, bf16: GB each "
            "GPU sends in one layer's forward?",
            theory.usp_bytes(s, 32, 8, 128, u, r, 2)["forward"] / 1e9,
            "Ulysses' all-to-alls on the group's S/r tokens plus the ring on heads/u heads with "
            "S/r tokens per rank" + _see(TWO_D) + ".")


def _striped_critical_path(rng):
    n = rng.choice([4, 8, 16])
    seq = 1024 * n
    return (f"Causal ring attention over {n} GPUs, {seq:,} tokens, FlashAttention-style kernel "
            "(masked halves skipped): the striped layout's critical path over zig-zag's?",
            theory.ring_critical_path(seq, n, "striped")
            / theory.ring_critical_path(seq, n, "zigzag"),
            "Striped: every step half a block of (S/N)^2 on every rank, N (S/N)(S/N+1)/2; "
            "zig-zag 2N (S/2N)^2 + S/2N: equal to within a diagonal" + _see(STRIPED) + ".")


def _document_zigzag(rng):
    n, long = rng.choice([2, 4, 8]), rng.choice([2048, 4096, 6144])
    lengths = [long] + [256] * ((8192 - long) // 256)
    return (f"Context parallelism over {n} GPUs with the zig-zag layout, 8,192 tokens packed as "
            f"one document of {long:,} followed by {len(lengths) - 1} documents of 256, a "
            "document mask (a token sees the earlier tokens of its own document), a kernel that "
            "skips masked pairs: the busiest GPU's score pairs over the mean?",
            document_imbalance(lengths, n, ("zigzag",))["zigzag"],
            "A query costs p - start + 1 pairs; zig-zag balances p, not p - start: count each "
            "rank's chunks (engine.cp.documents). Zig-zagging each document restores 1"
            + _see(DOCUMENTS) + ".")


ITEMS: list = [  # Numeric, Choice and Outline items of topic 'long context'
    Numeric("document-mask-zigzag", TOPIC, _document_zigzag, unit="x"),
    Numeric("ulysses-replicated-bytes", TOPIC, _replicated_ulysses_gb, unit="GB"),
    Numeric("ulysses-crossover", TOPIC, _ulysses_crossover, unit="GPUs"),
    Numeric("allgather-cp-bytes", TOPIC, _allgather_gb, unit="GB"),
    Numeric("allgather-over-ring-memory", TOPIC, _allgather_memory, unit="x"),
    Numeric("ring-backward-memory", TOPIC, _ring_backward_memory, unit="MB"),
    Numeric("usp-bytes", TOPIC, _usp_gb, unit="GB"),
    Numeric("striped-critical-path", TOPIC, _striped_critical_path, unit="x"),
    Choice("striped-is-not-zigzag", TOPIC,
           "Striped attention (Brandon et al. 2023) and the zig-zag layout both balance causal "
           "ring attention. How do they place the tokens?",
           ("Striped puts token t on rank t mod N; zig-zag gives rank r chunks r and 2N-1-r of "
            "2N", "They are the same layout under two names",
            "Striped gives each rank a contiguous chunk and reverses every other one"), 0,
           "Two different permutations: striped interleaves single tokens, so every block a rank "
           "computes is a triangle; zig-zag pairs an early and a late chunk.",
           (C09, STRIPED)),
    Choice("torch-context-parallel-default", TOPIC,
           "PyTorch's torch.distributed.tensor.experimental.context_parallel, as torchtitan "
           "calls it: how does it move K and V by default?",
           ("It all-gathers K/V on every rank (set_rotate_method('alltoall') switches to a "
            "ring of point-to-point exchanges)", "Round a ring, as Liu et al.'s ring attention",
            "With Ulysses' all-to-alls over heads"), 0,
           "The default rotate method is all-gather, the form Llama 3 (section 3.3.2) trained "
           "with; the chapter prints the option and the error it raises on a CPU.",
           (C09, TORCH)),
]
