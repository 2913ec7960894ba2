"""Checks for chapter 09: the online-softmax merge, a ring-attention forward, zig-zag shards,
Ulysses with KV heads replicated past their count. The ranks that run the learner's code (the
``_on_rank`` drivers, in :mod:`engine.grading.chapters.drivers_ch09`) return what they saw;
the attention they are compared with is computed here, in the grader."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from engine import theory
from engine.cp.blocks import block_forward
from engine.cp.layout import shard_indices
from engine.grading.chapters.drivers_ch09 import (
    RING_BATCH, RING_HEAD_DIM, RING_HEADS, RING_SEQ_PER_RANK, ULYSSES_BATCH, ULYSSES_HEAD_DIM,
    ULYSSES_PER_RANK, bad_degree_on_rank, rank_rows, ring_on_rank, ring_qkv, ulysses_on_rank,
    ulysses_qkv)
from engine.grading.core import POINT_TO_POINT, CheckFailed, Exercise, run_ranks
from engine.grading.drill import Drill

ATOL = 1e-5


def _attention(q, k, v):
    """Softmax attention over all keys at once, the reference."""
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def _blocks(q, k, v, splits):
    scale = 1 / math.sqrt(q.shape[-1])
    return [block_forward(q, kb, vb, scale) for kb, vb in zip(k.split(splits, -2),
                                                              v.split(splits, -2))]


def _merged(merge, blocks, q):
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"))
    for block_out, block_lse in blocks:
        out, lse = merge(out, lse, block_out, block_lse)
    return out, lse


def what_the_merge_got_wrong(out, lse, want_out, want_lse) -> str:
    """The one mistake the merge's result shows: an overflow, a wrong lse, or an output not
    rescaled; "" when both are right. Each diagnosis names only what was observed."""
    finite = bool(out.isfinite().all()) and not bool(lse.isnan().any())
    if not finite:
        return ("the merge overflowed (inf or NaN in its output): never form exp(lse); use "
                "torch.logaddexp and exp(lse_j - lse)")
    lse_ok = lse.shape == want_lse.shape and torch.allclose(lse, want_lse, atol=ATOL)
    out_ok = out.shape == want_out.shape and torch.allclose(out, want_out, atol=ATOL)
    if not lse_ok:
        also = " (the output is wrong too)" if not out_ok else ""
        return ("the merged lse is wrong: it is the log of both blocks' softmax mass, "
                f"torch.logaddexp(lse_1, lse_2){also}")
    if not out_ok:
        return ("the merged lse is right but the output is not: rescale each block's output, "
                "the one merged so far too, by exp(its lse - the new lse) before adding")
    return ""


def check_two_blocks_give_full_attention(merge):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 8, generator=g)
    k, v = (torch.randn(2, 3, 11, 8, generator=g) for _ in range(2))
    for splits in ([4, 7], [1, 10], [9, 2]):
        (o1, l1), (o2, l2) = _blocks(q, k, v, splits)
        out, lse = merge(o1, l1, o2, l2)
        full_lse = (q @ k.transpose(-2, -1) / math.sqrt(8)).logsumexp(-1)
        wrong = what_the_merge_got_wrong(out, lse, _attention(q, k, v), full_lse)
        if wrong:
            raise CheckFailed(f"merging two blocks does not give attention over all the keys: "
                              f"{wrong}", key_blocks=splits)


def _from_no_keys(merge):
    """``merge`` of one block of small scores into "no keys yet": ``((out, lse), block)``."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    (block_out, block_lse), = _blocks(q, k, v, [k.shape[-2]])
    empty = (torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf")))
    return merge(*empty, block_out, block_lse), (block_out, block_lse)


def check_starts_from_no_keys(merge):
    (out, lse), (block_out, block_lse) = _from_no_keys(merge)
    if out.isnan().any() or lse.isnan().any():
        raise CheckFailed("merging into 'no keys yet' (out = 0, lse = -inf) gave NaN: -inf - "
                          "(-inf) is NaN, so never subtract the two lse; torch.logaddexp "
                          "handles -inf, and exp(lse_j - lse) is then 0 for the empty side",
                          nan=True)
    if not (torch.allclose(out, block_out) and torch.allclose(lse, block_lse)):
        raise CheckFailed("merging into 'no keys yet' (out = 0, lse = -inf) must give the "
                          "block itself; got a different value (no NaN): "
                          + what_the_merge_got_wrong(out, lse, block_out, block_lse),
                          nan=False)


def check_large_scores_stay_finite(merge):
    g = torch.Generator().manual_seed(2)
    q = 500 * torch.randn(1, 2, 4, 16, generator=g)  # scores in the hundreds to thousands
    k, v = (torch.randn(1, 2, 12, 16, generator=g) for _ in range(2))
    blocks = _blocks(q, k, v, [3, 3, 3, 3])
    out, lse = _merged(merge, blocks, q)
    full_lse = (q @ k.transpose(-2, -1) / math.sqrt(16)).logsumexp(-1)
    wrong = what_the_merge_got_wrong(out, lse, _attention(q, k, v), full_lse)
    if wrong and any(t.isnan().any() for t in _from_no_keys(merge)[0]):  # small scores too
        wrong = ("the first merge, into 'no keys yet' (lse = -inf), gave NaN even with small "
                 "scores (see starts_from_no_keys), not an overflow")
    if wrong:
        raise CheckFailed(f"with scores near 1000, merging four blocks one by one: {wrong}",
                          finite=bool(out.isfinite().all()))


def _ring_results(impl):
    """Per N: the ranks' results, each with what the grader expects of it."""
    for n in (2, 3):
        q, k, v = ring_qkv(n)
        dense = F.scaled_dot_product_attention(q, k, v)
        sent = theory.ring_attention_bytes(RING_BATCH * n * RING_SEQ_PER_RANK,
                                           RING_HEADS * RING_HEAD_DIM, n,
                                           dtype_bytes=4)["forward"]
        results = run_ranks(ring_on_rank, n, impl, timeout=30)
        for rank, r in enumerate(results):
            r.update(expected=dense[..., rank_rows(rank, RING_SEQ_PER_RANK), :],
                     expected_sent=sent,
                     right=(rank + 1) % n,  # the right-hand neighbour in the world's ring
                     others=sorted({op for op, _ in r["events"]} - POINT_TO_POINT),
                     sends=[peer for op, peer in r["events"] if op in ("send", "isend")])
        yield n, results


def _equal(out, expected) -> bool:
    return isinstance(out, torch.Tensor) and out.shape == expected.shape and \
        torch.allclose(out, expected, atol=ATOL)


def check_equals_dense_attention(impl):
    for n, results in _ring_results(impl):
        for rank, r in enumerate(results):
            if not _equal(r["out"], r["expected"]):
                raise CheckFailed(f"rank {rank}: the output differs from attention over the "
                                  "whole sequence: merge one block per step, and pass K/V on "
                                  "to the right after each step but the last", world_size=n)


def check_n_minus_1_kv_exchanges(impl):
    for n, results in _ring_results(impl):
        for rank, r in enumerate(results):
            if r["others"]:
                raise CheckFailed(f"rank {rank}: the meter saw {r['others']}; the ring passes "
                                  "K/V with point-to-point exchanges only", world_size=n)
            if set(r["sends"]) != {r["right"]} or len(r["sends"]) not in (n - 1, 2 * (n - 1)):
                raise CheckFailed(f"rank {rank}: expected N-1 = {n - 1} exchanges of K and V "
                                  f"to the right-hand rank {r['right']}; the meter saw sends "
                                  f"to {r['sends']}", world_size=n)
            if r["sent"] != r["expected_sent"]:
                raise CheckFailed(f"rank {rank}: sent {r['sent']} bytes, expected 2 (N-1) "
                                  f"(S/N) x kv_hidden x 4 = {r['expected_sent']:.0f}",
                                  world_size=n)


ZIGZAG_CASES = [(2, 1, 0), (8, 2, 0), (8, 2, 1), (12, 3, 1), (24, 4, 3)]


def check_matches_the_layout(impl):
    for seq_len, n, rank in ZIGZAG_CASES:
        got = impl(seq_len, n, rank)
        want = shard_indices(seq_len, n, rank, "zigzag").tolist()
        if list(got) != want:
            raise CheckFailed(f"rank {rank} of {n} with {seq_len} tokens holds {want}, got "
                              f"{list(got)}: chunk r, then chunk 2n-1-r", seq_len=seq_len,
                              n=n, rank=rank)


def check_every_position_once_and_work_balanced(impl):
    for n in (2, 3, 5):
        seq_len = 6 * n
        held = [list(impl(seq_len, n, r)) for r in range(n)]
        if sorted(p for ranks in held for p in ranks) != list(range(seq_len)):
            raise CheckFailed("the ranks must hold every position exactly once", n=n,
                              held=held)
        work = [sum(p + 1 for p in positions) for positions in held]  # keys each query sees
        if len(set(work)) != 1:
            raise CheckFailed(f"causal work per rank {work} is not even: pair an early chunk "
                              "with a late one", n=n)


def check_bad_length_raises(impl):
    try:
        impl(9, 3, 0)
    except ValueError as e:
        if "9" not in str(e):
            raise CheckFailed(f"the ValueError should name the length 9; it says {str(e)!r}")
        return
    raise CheckFailed("9 tokens cannot be cut into 2 x 3 equal chunks: raise ValueError")


KV_CASES = [(4, 8, 2), (3, 6, 2)]  # (N, query heads, KV heads): N a multiple of kv; lcm


@functools.lru_cache(maxsize=4)
def _ulysses_results(impl):
    """Per case: the ranks' results, each with what the grader expects of it."""
    cases = []
    for n, heads, kv_heads in KV_CASES:
        q, k, v = ulysses_qkv(n, heads, kv_heads)
        dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        travelling = theory.ulysses_sent_kv_heads(heads, kv_heads, n)
        sent = theory.ulysses_bytes(ULYSSES_BATCH * n * ULYSSES_PER_RANK,
                                    heads * ULYSSES_HEAD_DIM, n, 4,
                                    travelling * ULYSSES_HEAD_DIM)["forward"]
        results = run_ranks(ulysses_on_rank, n, impl, heads, kv_heads, timeout=30)
        for rank, r in enumerate(results):
            r.update(expected=dense[..., rank_rows(rank, ULYSSES_PER_RANK), :],
                     expected_sent=sent, travelling=travelling, ops=sorted(set(r["ops"])))
        cases.append(((n, heads, kv_heads), results))
    return cases


def check_equals_attention_past_the_kv_heads(impl):
    for (n, heads, kv_heads), results in _ulysses_results(impl):
        for rank, r in enumerate(results):
            if not _equal(r["out"], r["expected"]):
                raise CheckFailed(f"rank {rank}: the output differs from causal attention over "
                                  f"the whole sequence ({heads} query heads, {kv_heads} KV heads "
                                  f"on {n} ranks): each rank needs the KV head of each of its "
                                  "query heads; replicate with repeat_interleave (copies of "
                                  "one head side by side), not repeat", world_size=n,
                                  heads=heads, kv_heads=kv_heads)


def check_sends_only_the_kv_heads_needed(impl):
    for (n, heads, kv_heads), results in _ulysses_results(impl):
        for rank, r in enumerate(results):
            if r["ops"] != ["all_to_all"]:
                raise CheckFailed(f"rank {rank}: the meter saw {r['ops']}; Ulysses moves heads "
                                  "with all-to-alls only", world_size=n)
            if r["sent"] != r["expected_sent"]:
                raise CheckFailed(
                    f"rank {rank}: sent {r['sent']:.0f} bytes, expected {r['expected_sent']:.0f} "
                    f"with lcm({kv_heads}, {n}) = {r['travelling']} KV heads travelling: "
                    "replicate each KV head only as often as the ranks need it (not to every "
                    "query head)", world_size=n, heads=heads, kv_heads=kv_heads)


def check_bad_degree_raises(impl):
    for message in run_ranks(bad_degree_on_rank, 2, impl, timeout=30):
        if message is None:
            raise CheckFailed("3 query heads cannot be split over 2 ranks: raise ValueError "
                              "before any all-to-all")
        if "3" not in message or "2" not in message:
            raise CheckFailed(f"the ValueError should name the 3 heads and the 2 ranks; it says "
                              f"{message!r}")


EXERCISES = [
    Exercise(
        name="ch09.online_softmax",
        title="The online-softmax merge of two blocks",
        module="ch09_online_softmax",
        attr="merge",
        checks=(check_two_blocks_give_full_attention, check_starts_from_no_keys,
                check_large_scores_stay_finite),
        hints=(
            "Each block's output is normalised over its own keys only. To join two, weight each "
            "by its share of the total softmax mass, exp(lse_j) / (exp(lse_1) + exp(lse_2)), "
            "computed without ever forming exp(lse).",
            "torch.logaddexp(a, b) is log(exp(a) + exp(b)) without overflow, and handles -inf; "
            "exp(lse_j - lse) is block j's weight; [..., None] broadcasts a per-query weight "
            "over head_dim.",
            "lse = torch.logaddexp(lse_1, lse_2); out = out_1 * exp(lse_1 - lse)[..., None] + "
            "out_2 * exp(lse_2 - lse)[..., None]; return out, lse.",
        ),
        blocks=("engine.cp.blocks.merge",),
    ),
    Exercise(
        name="ch09.ring_forward",
        title="Ring attention forward, no mask",
        module="ch09_ring_forward",
        attr="ring_attention_forward",
        checks=(check_equals_dense_attention, check_n_minus_1_kv_exchanges),
        hints=(
            "Keep your queries and let the keys and values travel: in N steps each rank attends "
            "to the K/V block it holds, merges the result into its running output, and passes "
            "the block to its right-hand neighbour.",
            "ring_position(group) gives (me, n, right, left); block_forward(q, k, v, scale) "
            "returns (out, lse) for one block; merge(out, lse, block_out, block_lse) joins two; "
            "exchange(send, right, recv, left, group) passes a block on; torch.stack([k, v]) "
            "carries both in one exchange.",
            "out = zeros_like(q); lse = full(q.shape[:-1], -inf); kv = stack([k, v]); for step "
            "in range(n): out, lse = merge(out, lse, *block_forward(q, kv[0], kv[1], scale)); "
            "if step < n - 1: incoming = empty_like(kv); exchange(kv, right, incoming, left, "
            "group); kv = incoming. Return out.",
        ),
        blocks=("engine.cp.ring.ring_attention", "engine.cp.ring._RingAttention.forward",
                "engine.cp.ulysses.ulysses_attention"),
    ),
    Exercise(
        name="ch09.zigzag_indices",
        title="The zig-zag shard of a rank",
        module="ch09_zigzag_indices",
        attr="zigzag_indices",
        checks=(check_matches_the_layout, check_every_position_once_and_work_balanced,
                check_bad_length_raises),
        hints=(
            "Under a causal mask late tokens cost more than early ones. Cut the sequence into "
            "2n chunks and give each rank one early and one late chunk, so every rank does the "
            "same work.",
            "range(start, stop) builds a chunk's positions; a chunk holds seq_len // (2 * n) "
            'tokens; raise ValueError(f"... {seq_len} ...") when seq_len % (2 * n) != 0.',
            "c = seq_len // (2 n); return [*range(rank c, (rank + 1) c), *range((2n - 1 - rank) "
            "c, (2n - rank) c)].",
        ),
        blocks=("engine.cp.layout.shard_indices", "engine.cp.layout.rank_chunks"),
    ),
    Exercise(
        name="ch09.kv_replication",
        title="Ulysses past the KV heads: KV heads replicated",
        module="ch09_kv_replication",
        attr="ulysses_gqa_attention",
        checks=(check_equals_attention_past_the_kv_heads, check_sends_only_the_kv_heads_needed,
                check_bad_degree_raises),
        hints=(
            "A rank takes whole query heads, heads/N of them, and needs the KV head of each. "
            "When N does not divide the KV heads, give every rank its own copy: replicate each "
            "KV head so that lcm(kv_heads, N) heads travel, lcm/N to each rank.",
            "math.lcm(kv_heads, n); t.repeat_interleave(r, dim=1) puts r copies of each head "
            "side by side (t.repeat would tile them in the wrong order); heads_all_to_all(t, "
            "group, 1, 2) swaps sequence-sharded for head-sharded, heads_all_to_all(out, group, "
            "2, 1) swaps back.",
            "if heads % n: raise ValueError(...); r = lcm(kv, n) // kv; k, v = (t."
            "repeat_interleave(r, 1) for t in (k, v)); q, k, v = (heads_all_to_all(t, group, 1, "
            "2) for t in (q, k, v)); out = F.scaled_dot_product_attention(q, k, v, is_causal="
            "True, enable_gqa=True); return heads_all_to_all(out, group, 2, 1).",
        ),
        blocks=("engine.cp.ulysses.ulysses_attention", "engine.cp.ulysses.scatter_heads",
                "engine.cp.ulysses.replicate_kv_heads", "engine.cp.twod.usp_attention"),
    ),
]

DRILLS = [  # questions from engine.drill's bank: the answers are computed, not typed
    Drill("ch09.ring_forward_gb", "ring-attention-bytes"),
    Drill("ch09.contiguous_imbalance", "causal-imbalance"),
    Drill("ch09.ulysses_degree", "ulysses-any-degree"),
    Drill("ch09.ulysses_crossover", "ulysses-crossover"),
    Drill("ch09.allgather_memory", "allgather-over-ring-memory"),
]
