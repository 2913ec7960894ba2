"""Long sequences: sequence and context parallelism (chapter 09).

Part of :mod:`engine.theory`: pure formulas, each naming its source; sizes in bytes.
"""

from __future__ import annotations

import math

from engine.theory.collectives import all_to_all_bytes, check_n


def sp_activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int,
                                  tp: int = 1) -> float:
    """Activation bytes per layer per GPU with tensor *and* sequence parallelism ``tp``
    (Korthikanti et al., MLSys 2023, section 4.2.2): ``s b h / t (34 + 5 a s / h)``. Against
    equation 2 (:func:`tp_activation_bytes_per_layer`) the ``10 s b h`` that tensor parallelism
    leaves replicated (LayerNorm and dropout regions, and the inputs of the first linear of
    attention and MLP) is divided by ``t`` too."""
    check_n(tp)
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    return s * b * h / t * (34 + 5 * a * s / h)


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int,
                               tp: int = 1, cp: int = 1, sequence_parallel: bool = False,
                               recompute: bool = False, flash_attention: bool | None = None
                               ) -> float:
    """Activation bytes per layer per GPU under tensor parallelism ``tp`` (with or without
    sequence parallelism) and context parallelism ``cp``. Context parallelism gives each rank
    ``s/cp`` tokens of every activation, so the token-wise terms of Korthikanti et al. 2023
    apply to ``s/cp`` tokens: equation 2 (:func:`tp_activation_bytes_per_layer`) or, with
    sequence parallelism, :func:`sp_activation_bytes_per_layer`. The attention-score term is
    not squared in ``s/cp``: a rank's ``s/cp`` queries meet all ``s`` keys, so a kernel that
    stored its scores would keep ``5 a (s/cp) s b / t``; FlashAttention-style kernels store
    none (``flash_attention=True`` drops the term). The default, ``None``, keeps the scores
    without context parallelism and drops them with it (ring attention, Ulysses and all-gather
    CP all compute attention block by block: :mod:`engine.cp`).
    Full recomputation keeps the layer input, ``2 (s/cp) b h``, divided by ``t`` too when it
    is sequence-parallel."""
    check_n(cp)
    check_n(tp)
    s, b, h, a, t = seq_len / cp, micro_batch, hidden, heads, tp
    if recompute:
        return 2 * s * b * h / (t if sequence_parallel else 1)
    tokens = 34 * s * b * h / t if sequence_parallel else s * b * h * (10 + 24 / t)
    if flash_attention is None:
        flash_attention = cp > 1
    scores = 0 if flash_attention else 5 * a * s * seq_len * b / t
    return tokens + scores


def sp_comm_elements_per_layer(b: int, s: int, h: int, t: int) -> float:
    """Elements each rank sends per layer per micro-batch under Megatron tensor + sequence
    parallelism: each of the 4 all-reduces of :func:`tp_comm_elements_per_layer` becomes a
    reduce-scatter and an all-gather, ``(t-1)/t bsh`` each (the same bytes), plus one more
    all-gather per column-parallel layer in backward, which rebuilds the layer's input from the
    stored ``s/t`` shard for the weight gradient (Korthikanti et al. 2023, section 4.2.2):
    ``10 bsh (t-1)/t``."""
    check_n(t)
    return 10 * b * s * h * (t - 1) / t


def ring_attention_bytes(seq: int, kv_hidden: int, n: int, dtype_bytes: float = 2
                         ) -> dict[str, float]:
    """Bytes each rank sends (and receives) per attention layer in ring attention over ``n``
    ranks (Liu et al., "Ring attention", 2023): ``seq`` tokens in all (batch x sequence),
    ``kv_hidden`` = KV heads x head_dim. Forward: N-1 steps, each passing one ``S/N``-token K
    and V block on, ``2 (N-1) (S/N) kv_hidden``. Backward: the K/V blocks again and the dK/dV
    accumulators, twice the forward. Close to ``2 S kv_hidden`` forward whatever N."""
    check_n(n)
    forward = 2 * (n - 1) * seq / n * kv_hidden * dtype_bytes
    return {"forward": forward, "backward": 2 * forward, "total": 3 * forward}


def ulysses_bytes(seq: int, hidden: int, n: int, dtype_bytes: float = 2,
                  kv_hidden: int | None = None) -> dict[str, float]:
    """Bytes each rank sends (and receives) per attention layer in DeepSpeed-Ulysses over ``n``
    ranks (Jacobs et al. 2023, section 3): an all-to-all of q, k and v, one of the output, each
    sending ``(N-1)/N`` of the rank's ``S/N`` tokens (:func:`all_to_all_bytes`), and the same
    two backward. ``kv_hidden`` (KV heads x head_dim, grouped-query attention; the travelling
    heads, :func:`ulysses_sent_kv_heads`, when KV heads are replicated) defaults to ``hidden``:
    ``(N-1)/N^2 S (2 hidden + 2 kv_hidden)`` each way, falling as 1/N. Against the ring's
    ``2 (N-1)/N S kv_hidden`` it is fewer bytes only for ``N > 1 + hidden/kv_hidden``
    (:func:`ulysses_beats_ring`): with 4 query heads per KV head, from N = 8."""
    check_n(n)
    kv = hidden if kv_hidden is None else kv_hidden
    forward = all_to_all_bytes(seq / n * (2 * hidden + 2 * kv) * dtype_bytes, n)
    return {"forward": forward, "backward": forward, "total": 2 * forward}


def ulysses_sent_kv_heads(heads: int, kv_heads: int, n: int) -> int:
    """KV heads that travel in Ulysses over ``n`` ranks: ``lcm(kv_heads, n)``. ``n`` must
    divide the query heads (a rank takes whole query heads); when it does not divide
    ``kv_heads`` each KV head is replicated ``lcm / kv_heads`` times so that every rank gets
    the KV heads of its query heads (``kv_heads`` itself when ``n`` divides it)."""
    check_n(n)
    if heads % n or heads % kv_heads:
        raise ValueError(f"Ulysses needs n = {n} and kv_heads = {kv_heads} to divide the "
                         f"{heads} query heads")
    return math.lcm(kv_heads, n)


def ulysses_beats_ring(heads: int, kv_heads: int, n: int) -> bool:
    """Whether Ulysses sends fewer bytes per rank than the ring, from :func:`ulysses_bytes`
    and :func:`ring_attention_bytes`: ``(N-1)/N^2 S (2 h_q + 2 h_kv') d < 2 (N-1)/N S h_kv d``,
    that is ``h_q + h_kv' < N h_kv``. When ``n`` divides ``kv_heads`` (``h_kv' = h_kv``):
    ``N > 1 + h_q / h_kv``. Llama-3-8B (32 query, 8 KV heads): only from N > 5."""
    travelling = ulysses_sent_kv_heads(heads, kv_heads, n)
    return n > 1 and heads + travelling < n * kv_heads


def allgather_cp_bytes(seq: int, kv_hidden: int, n: int, dtype_bytes: float = 2
                       ) -> dict[str, float]:
    """Bytes each rank sends (and receives) per attention layer in all-gather context
    parallelism (Llama 3, section 3.3.2; PyTorch ``context_parallel``'s default). Forward: one
    all-gather of the rank's ``S/N`` tokens of K and V, ``(N-1)/N * 2 S kv_hidden``, the ring's
    forward bytes. Backward: K/V gathered again and the whole-sequence dK/dV reduce-scattered,
    twice the forward, as the ring."""
    check_n(n)
    forward = (n - 1) / n * 2 * seq * kv_hidden * dtype_bytes
    return {"forward": forward, "backward": 2 * forward, "total": 3 * forward}


def usp_bytes(seq: int, heads: int, kv_heads: int, head_dim: int, ulysses: int, ring: int,
              dtype_bytes: float = 2) -> dict[str, float]:
    """Bytes each rank sends per attention layer in 2D attention ("USP", Fang & Zhao 2024):
    Ulysses over ``ulysses`` ranks (:func:`ulysses_bytes` on the group's ``S/ring`` tokens,
    ``lcm(kv_heads, ulysses)`` KV heads travelling) plus ring attention over ``ring`` groups
    on ``heads/ulysses`` heads, each ring rank holding ``S/ring`` tokens
    (:func:`ring_attention_bytes` with ``lcm / ulysses`` KV heads)."""
    travelling = ulysses_sent_kv_heads(heads, kv_heads, ulysses)
    uly = ulysses_bytes(seq / ring, heads * head_dim, ulysses, dtype_bytes,
                        travelling * head_dim)
    rng = ring_attention_bytes(seq, travelling // ulysses * head_dim, ring, dtype_bytes)
    return {key: uly[key] + rng[key] for key in ("forward", "backward", "total")}


CP_METHODS = ("ring", "ulysses", "allgather", "usp")


def cp_memory_bytes(method: str, seq: int, heads: int, kv_heads: int, head_dim: int, n: int,
                    dtype_bytes: float = 2, acc_bytes: float = 4, ulysses: int = 1
                    ) -> dict[str, float]:
    """The most bytes of sequence-sized working buffers a rank holds at once per attention
    layer (besides its own ``S/N`` tokens of q, k, v and output), as :class:`engine.cp.buffers.
    BufferCount` counts them; ``seq`` = batch x sequence tokens, ``acc_bytes`` the accumulation
    dtype's size (4, or 8 for fp64 inputs).

    * ``"ring"``: forward, the K/V block in use and the one arriving, ``2 x 2 (S/N) kv d``
      (double buffering); backward, those two, this rank's own dK/dV and the step's share in
      the accumulation dtype, and the travelling dK/dV accumulator's send and receive buffers
      (``2 (S/N) kv d (b (3 + [N > 2]) + 2 acc)``; on 2 ranks the last step has no next block).
    * ``"ulysses"`` (forward): whole-sequence q and output of ``heads/N`` heads, k and v of the
      ``lcm(kv, N)/N`` travelling KV heads, ``S d (2 heads + 2 lcm) / N``; backward holds their
      gradients, the same size (not counted by the engine: autograd holds them).
    * ``"allgather"``: forward the whole K/V, ``2 S kv d b``; backward that, whole-sequence
      dK/dV in the accumulation dtype (and its copy in the input dtype when narrower), and
      the reduce-scattered ``2 (S/N) kv d``.
    * ``"usp"`` (``n`` ranks, ``ulysses`` per group): forward the larger of the scattered q, k,
      v (``S/r`` tokens, ``heads/u`` and ``2 lcm/u`` heads) and the ring's two K/V blocks on
      them; backward the ring's backward on ``S/r`` tokens of ``lcm/u`` KV heads.
    """
    if method not in CP_METHODS:
        raise ValueError(f"method must be one of {CP_METHODS}, got {method!r}")
    check_n(n)
    b, acc, d = dtype_bytes, acc_bytes, head_dim
    if method == "ring":
        if n == 1:
            return {"forward": 0, "backward": 0}
        block = 2 * seq / n * kv_heads * d
        return {"forward": 2 * block * b, "backward": block * (b * (3 + (n > 2)) + 2 * acc)}
    if method == "ulysses":
        travelling = ulysses_sent_kv_heads(heads, kv_heads, n)
        size = seq * d * (2 * heads + 2 * travelling) / n * b
        return {"forward": size, "backward": size}
    if method == "allgather":
        whole = 2 * seq * kv_heads * d
        copy = whole * b if b != acc else 0
        return {"forward": whole * b,
                "backward": whole * b + whole * acc + copy + whole / n * b}
    u, r = ulysses, n // ulysses
    travelling = ulysses_sent_kv_heads(heads, kv_heads, u)
    scattered = seq / r * d * (heads + 2 * travelling) / u * b
    ring = cp_memory_bytes("ring", seq, heads // u, travelling // u, d, r, b, acc)
    return {"forward": max(scattered, ring["forward"]), "backward": ring["backward"]}


def ring_attention_flops(seq: int, n: int, rank: int, layout: str = "zigzag",
                         causal: bool = True, heads: int = 1, head_dim: int = 1,
                         batch: int = 1) -> float:
    """Forward FLOPs ``rank`` executes in ring attention (``QK^T`` and ``PV``, 4 b a d per
    query-key pair of a computed block; a block on the causal diagonal is computed whole and
    masked, a block above it skipped). Causal, contiguous: rank r computes ``r + 1`` blocks of
    ``(S/N)^2``, so the last rank does ``2N/(N+1)`` times the average. Zig-zag: every rank
    ``2N + 1`` blocks of ``(S/2N)^2``. Not causal: ``S^2/N`` each."""
    check_n(n)
    if layout not in ("zigzag", "contiguous"):
        raise ValueError(f"layout must be 'zigzag' or 'contiguous', got {layout!r}")
    if not causal:
        pairs = seq * seq / n
    elif layout == "contiguous":
        pairs = (rank + 1) * (seq / n) ** 2
    else:
        pairs = (2 * n + 1) * (seq / (2 * n)) ** 2
    return 4 * batch * heads * head_dim * pairs


def ring_critical_path(seq: int, n: int, layout: str = "zigzag", skip_masked: bool = True
                       ) -> float:
    """Query-key pairs on causal ring attention's critical path: the sum over the N lock-step
    ring steps of the busiest rank's pairs. With ``c = S/(2N)``:

    * ``skip_masked=True`` (FlashAttention-style kernels compute only the visible half of a
      diagonal block): contiguous ``(4N-2) c^2 + c`` (N-1 full blocks of ``(2c)^2`` and one
      diagonal), zig-zag ``2N c^2 + c`` (two sub-blocks per step): a speed-up tending to
      ``2 - 1/N``; striped (Brandon et al. 2023) ``N (2c)(2c+1)/2``, about the zig-zag's;
    * ``skip_masked=False`` (diagonal blocks computed whole and masked, as the engine does):
      contiguous ``4N c^2``, zig-zag ``(2N+1) c^2`` (ratio ``4N/(2N+1)``), striped ``4N c^2``."""
    check_n(n)
    if layout not in ("zigzag", "contiguous", "striped"):
        raise ValueError(f"layout must be 'zigzag', 'contiguous' or 'striped', got {layout!r}")
    c = seq / (2 * n)
    if not skip_masked:
        return (2 * n + 1) * c * c if layout == "zigzag" else 4 * n * c * c
    if layout == "contiguous":
        return (4 * n - 2) * c * c + c
    if layout == "zigzag":
        return 2 * n * c * c + c
    return n * (2 * c) * (2 * c + 1) / 2
