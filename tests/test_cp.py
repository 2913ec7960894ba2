"""engine.cp: ring attention (zig-zag and contiguous) and Ulysses equal dense attention, count
the bytes of engine.theory and balance the causal load as theory says. (The GPT trained with
context parallelism, alone and with dp, equal to one process: the parity matrix's cp rows,
tests/test_parity.py.)

Tolerances, stated once:
* fp32: outputs and the gradients of q, k and v within ``atol=1e-5`` of PyTorch's
  ``scaled_dot_product_attention`` on the whole sequence (measured: about 1e-6);
* bf16: against an fp64 reference, no worse than 1.5x the error of PyTorch's own bf16
  ``scaled_dot_product_attention`` on the whole sequence, and within ``2^-6`` of the largest
  magnitude (4 bf16 steps).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import RankError, theory
from engine.observe.meter import CommMeter
from engine.cp import (check_sequence_split, check_ulysses_heads, gather_sequence,
                       ring_attention, ring_schedule, shard_indices, shard_sequence,
                       ulysses_attention)
from tests.helpers import BEYOND_CPU, rank_device, run_ranks

# per N: (heads, kv heads, zig-zag length, contiguous and Ulysses length); odd where it can be
SIZES = {1: (4, 2, 8, 7), 2: (4, 2, 12, 10), 3: (6, 3, 12, 9), 4: (8, 4, 16, 12)}
ATOL_FP32 = 1e-5


def _inputs(n, seq_len, dtype, seed=0, batch=2, head_dim=8):
    heads, kv_heads = SIZES[n][:2]
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, h, seq_len, head_dim) for h in (heads, kv_heads, kv_heads, heads)]
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]  # q, k, v, grad of out


def _dense(q, k, v, grad, causal, dtype):
    leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal,
                                         enable_gqa=k.shape[1] != q.shape[1])
    out.backward(grad.to(dtype))
    return [out.detach()] + [t.grad for t in leaves]


def _parallel(q, k, v, grad, attention, causal, layout):
    leaves = [shard_sequence(t, None, layout).requires_grad_() for t in (q, k, v)]
    if attention == "ring":
        out = ring_attention(*leaves, causal=causal, layout=layout)
    else:
        out = ulysses_attention(*leaves, causal=causal)
    out.backward(shard_sequence(grad, None, layout))
    return [gather_sequence(t, None, layout) for t in [out] + [t.grad for t in leaves]]


CASES = [("ring", "zigzag"), ("ring", "contiguous"), ("ulysses", "contiguous")]


def _errors(rank, n, dtype):
    """{(attention, layout, causal): max errors of (out, dq, dk, dv), and the reference's}."""
    found = {}
    for attention, layout in CASES:
        seq_len = SIZES[n][2] if layout == "zigzag" else SIZES[n][3]
        q, k, v, grad = _inputs(n, seq_len, dtype)
        for causal in (True, False):
            got = _parallel(q, k, v, grad, attention, causal, layout)
            if dtype == torch.float32:
                want = _dense(q, k, v, grad, causal, torch.float32)
                found[attention, layout, causal] = [(g - w).abs().max().item()
                                                    for g, w in zip(got, want)]
            else:
                exact = _dense(q, k, v, grad, causal, torch.float64)
                builtin = _dense(q, k, v, grad, causal, dtype)
                found[attention, layout, causal] = [
                    ((g.double() - e).abs().max().item(), (b.double() - e).abs().max().item(),
                     e.abs().max().item()) for g, b, e in zip(got, builtin, exact)]
    return found


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ring_and_ulysses_equal_dense_attention_and_its_gradients_in_fp32(n):
    for rank, found in enumerate(run_ranks(_errors, n, torch.float32)):
        for case, errors in found.items():
            assert max(errors) <= ATOL_FP32, (rank, case, errors)


@pytest.mark.parametrize("n", [2, 4])
def test_bf16_is_as_close_to_exact_as_pytorchs_own_bf16_attention(n):
    for found in run_ranks(_errors, n, torch.bfloat16):
        for case, rows in found.items():
            for mine, builtin, magnitude in rows:  # out, dq, dk, dv
                assert mine <= 1.5 * builtin and mine <= 2**-6 * magnitude, (case, rows)


def _on_device(rank, n, device):
    on = rank_device(device)
    found = {}
    for attention, layout in CASES:
        q, k, v, grad = (t.to(on) for t in _inputs(n, SIZES[n][2], torch.float32))
        got = _parallel(q, k, v, grad, attention, True, layout)
        want = _dense(q, k, v, grad, True, torch.float32)
        found[attention, layout] = max((g - w).abs().max().item() for g, w in zip(got, want))
    return found


@pytest.mark.parametrize("device", BEYOND_CPU)
def test_ring_and_ulysses_on_each_device(device):
    """Host-staged Gloo ('cpu-staged', what a one-GPU machine runs) and CUDA (marked gpu)."""
    for found in run_ranks(_on_device, 2, device, device=device):
        assert max(found.values()) <= ATOL_FP32, found


def _bytes(rank, n, layout, attention):
    heads, kv_heads = SIZES[n][:2]
    seq_len = 8 * n
    q, k, v, grad = _inputs(n, seq_len, torch.float32, batch=1)
    leaves = [shard_sequence(t, None, layout).requires_grad_() for t in (q, k, v)]
    with CommMeter(count="wire") as forward:
        if attention == "ring":
            out = ring_attention(*leaves, layout=layout)
        else:
            out = ulysses_attention(*leaves)
    with CommMeter(count="wire") as backward:
        out.backward(shard_sequence(grad, None, layout))
    return [(m.bytes_sent, m.bytes_received, m.all_counted, [e.op for e in m.events])
            for m in (forward, backward)]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_counted_bytes_equal_the_formulas(n):
    heads, kv_heads = SIZES[n][:2]
    seq_len, head_dim = 8 * n, 8
    ring = theory.ring_attention_bytes(seq_len, kv_heads * head_dim, n, dtype_bytes=4)
    ulysses = theory.ulysses_bytes(seq_len, heads * head_dim, n, dtype_bytes=4,
                                   kv_hidden=kv_heads * head_dim)
    for layout in ("zigzag", "contiguous"):
        for forward, backward in run_ranks(_bytes, n, layout, "ring"):
            assert forward[:3] == (ring["forward"], ring["forward"], True)
            assert backward[:3] == (ring["backward"], ring["backward"], True)
            # one K/V message per step: N-1 forward; K/V and dK/dV backward
            assert forward[3].count("isend") == n - 1
            assert backward[3].count("isend") == 2 * (n - 1)
    for forward, backward in run_ranks(_bytes, n, "contiguous", "ulysses"):
        assert forward[:3] == (ulysses["forward"], ulysses["forward"], True)
        assert backward[:3] == (ulysses["backward"], ulysses["backward"], True)
        assert forward[3] == backward[3] == ["all_to_all", "all_to_all"]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_the_ring_schedule_covers_the_causal_mask_once_and_skips_masked_blocks(n, layout):
    seq_len = 4 * n
    chunk = check_sequence_split(seq_len, n, layout)
    covered = torch.zeros(seq_len, seq_len, dtype=torch.int64)
    schedule = ring_schedule(n, layout, causal=True)
    for rank, steps in schedule.items():
        mine = shard_indices(seq_len, n, rank, layout)
        pairs = 0
        for step, block_pairs in enumerate(steps):
            theirs = shard_indices(seq_len, n, (rank - step) % n, layout)
            for a, b, kind in block_pairs:
                rows = mine[a * chunk:(a + 1) * chunk]
                cols = theirs[b * chunk:(b + 1) * chunk]
                visible = rows[:, None] >= cols[None, :]
                assert visible.any()  # no fully masked block is computed
                assert visible.all() == (kind == "full")
                covered[rows[:, None], cols[None, :]] += visible.long()
                pairs += chunk * chunk
        flops = 4 * pairs  # per (batch, head, head_dim)
        assert flops == theory.ring_attention_flops(seq_len, n, rank, layout)
    assert torch.equal(covered, torch.ones(seq_len, seq_len, dtype=torch.int64).tril())


def test_zigzag_balances_the_causal_work_and_contiguous_does_not():
    for n in (2, 4, 8):
        contiguous = [theory.ring_attention_flops(64 * n, n, r, "contiguous") for r in range(n)]
        zigzag = [theory.ring_attention_flops(64 * n, n, r, "zigzag") for r in range(n)]
        assert len(set(zigzag)) == 1  # every rank the same work
        assert max(contiguous) / (sum(contiguous) / n) == pytest.approx(2 * n / (n + 1))
        assert max(contiguous) / max(zigzag) == pytest.approx(4 * n / (2 * n + 1))


def test_sequences_that_do_not_split_are_clear_errors_before_any_rank_starts():
    with pytest.raises(ValueError, match=r"sequence length 9 does not split into the 2 x 3 = 6 "
                                         r"equal chunks the zigzag layout needs on 3 ranks"):
        check_sequence_split(9, 3, "zigzag")
    with pytest.raises(ValueError, match="sequence length 10 does not split into the 4 equal"):
        check_sequence_split(10, 4, "contiguous")
    with pytest.raises(ValueError, match="layout must be one of 'zigzag', 'contiguous', "
                                         "'striped'"):
        check_sequence_split(8, 2, "diagonal")
    assert check_sequence_split(9, 3, "contiguous") == 3


def test_heads_that_do_not_split_are_clear_errors_before_any_rank_starts():
    with pytest.raises(ValueError, match=r"6 query heads do not split over 4 ranks"):
        check_ulysses_heads(6, 6, 4)
    # issue 32: the limit is the query heads; KV heads are replicated past kv_heads
    assert check_ulysses_heads(8, 2, 4) == 4 and check_ulysses_heads(12, 4, 6) == 12
    assert check_ulysses_heads(8, 4, 4) == 4


def _mismatched(rank, n):
    local = 4 if rank == 0 else 6  # rank 0 holds fewer tokens
    q = torch.randn(1, 2, local, 8)
    ring_attention(q, q, q, layout="contiguous")


def _ulysses_heads_on_ranks(rank, n):
    q = torch.randn(1, 3, 4, 8)
    ulysses_attention(q, q, q)


def test_mismatched_shapes_and_heads_on_the_ranks_are_clear_errors():
    with pytest.raises(RankError, match=r"ranks hold different shapes \(rank 0: q \(1, 2, 4, "
                                        r"8\), 2 kv heads, torch.float32; rank 1: q \(1, 2, 6"):
        run_ranks(_mismatched, 2)
    with pytest.raises(RankError, match="3 query heads do not split over 2 ranks"):
        run_ranks(_ulysses_heads_on_ranks, 2)


def test_gather_undoes_shard_for_both_layouts():
    def roundtrip(rank, n):
        x = torch.arange(2 * 3 * 12.0).view(2, 3, 12, 1)
        return [torch.equal(gather_sequence(shard_sequence(x, None, layout), None, layout), x)
                for layout in ("zigzag", "contiguous")]

    assert all(all(r) for r in run_ranks(roundtrip, 3))
    assert shard_indices(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]
    assert shard_indices(8, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]


# -- theory, planner and figures ----------------------------------------------------------------


def test_activation_forms_compose_tp_sp_and_cp():
    s, b, h, a = 8192, 1, 4096, 32
    assert theory.activation_bytes_per_layer(s, b, h, a, tp=8) == \
        theory.tp_activation_bytes_per_layer(s, b, h, a, 8)
    assert theory.activation_bytes_per_layer(s, b, h, a, tp=8, sequence_parallel=True) == \
        theory.sp_activation_bytes_per_layer(s, b, h, a, 8) == s * b * h / 8 * (34 + 5 * a * s / h)
    # issue 32: a rank's s/cp queries meet all s keys: 5 a (s/cp) s b / t, not 5 a (s/cp)^2 b
    # (and 0 with flash attention, the default under context parallelism)
    assert theory.activation_bytes_per_layer(s, b, h, a, tp=2, cp=4, flash_attention=False) \
        == (s / 4) * b * h * (10 + 24 / 2) + 5 * a * (s / 4) * s * b / 2
    assert theory.activation_bytes_per_layer(s, b, h, a, tp=2, cp=4) == \
        (s / 4) * b * h * (10 + 24 / 2)
    assert theory.activation_bytes_per_layer(s, b, h, a, tp=8, cp=2, sequence_parallel=True,
                                             recompute=True) == 2 * (s / 2) * b * h / 8


def test_the_planner_enumerates_context_and_sequence_parallelism():
    import dataclasses

    from engine.theory.planner import MODELS, Cluster, memory_per_gpu, plan, step_time

    spec = dataclasses.replace(MODELS["LLaMA 7B"], seq_len=131072)
    cluster = Cluster(64)
    memory = memory_per_gpu(spec, 2, 8, 1, 1, 1, 1, recompute=False, cp=4, sp=True)
    assert memory["activations"] == 32 * theory.activation_bytes_per_layer(
        131072, 1, 4096, 32, 8, 4, True)
    assert memory["optimizer"] == theory.zero_model_state_bytes(spec.params / 8, 2 * 4,
                                                                1)["optimizer"]
    t = step_time(spec, cluster, 2, 8, 1, 1, 1, 64, recompute=False, cp=4, sp=True)
    ring = theory.ring_attention_bytes(131072, 4096, 4, 2)["total"] / 8  # each tp rank its heads
    m = 64 // 2
    assert t["cp"] == pytest.approx(32 * m * (3 * 3 * cluster.alpha_inter
                                              + ring / (cluster.inter_gbps * 1e9)))
    assert step_time(spec, cluster, 16, 4, 1, 1, 1, 64)["cp"] == 0
    plans = plan(spec, cluster, 64, recompute=False, cp_degrees=(1, 2, 4, 8, 16, 32, 64),
                 sequence_parallel=True)
    assert plans and any(p.cp > 1 for p in plans)
    for p in plans:
        assert p.dp * p.ep * p.cp * p.tp * p.pp == 64 and 131072 % (2 * p.cp) == 0
        assert p.sp == (p.tp > 1)
    # 128k tokens without recomputation: nothing fits unless the sequence is split
    assert not plan(spec, cluster, 64, recompute=False)


def test_figures_and_explorers_draw():
    import matplotlib

    matplotlib.use("Agg")
    from engine.viz.cp import long_context_rows, ring_explorer, ring_step_figure
    from engine.viz.zero import per_gpu_bytes

    assert ring_step_figure(4, "zigzag", 2).axes and ring_explorer() is not None
    rows = long_context_rows([4096, 65536], n=8)
    assert rows["memory"]["TP+SP 8"] == rows["memory"]["ring CP 8"] == rows["memory"]["Ulysses 8"]
    assert all(u < r < t for u, r, t in zip(rows["bytes"]["Ulysses 8"], rows["bytes"]["ring CP 8"],
                                           rows["bytes"]["TP 8"]))
    one = per_gpu_bytes("LLaMA 7B", 8, 3, checkpoint=True, seq_len=131072)
    four = per_gpu_bytes("LLaMA 7B", 8, 3, checkpoint=True, seq_len=131072, cp=4)
    assert one["activations"] == 4 * four["activations"] == 32 * 2 * 131072 * 4096
