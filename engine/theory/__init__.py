"""Pure formulas the course checks against measurements. No ``torch.distributed`` in here.

Each function names its source. Sizes are in bytes; ``n`` is the number of ranks in the group.

Communication volume of ring collectives (Patarasuk & Yuan, "Bandwidth optimal all-reduce
algorithms for clusters of workstations", JPDC 2009; the same factors nccl-tests uses for bus
bandwidth, see its doc/PERFORMANCE.md):

* reduce-scatter and all-gather: each rank sends and receives ``(n-1)/n * S``
  (``S`` = the size of the full, unsharded tensor);
* all-reduce = reduce-scatter + all-gather: ``2(n-1)/n * S`` each way per rank;
* broadcast as a pipelined chain: every rank but the root receives ``S``; every rank but the
  last in the chain forwards ``S``.
"""

from __future__ import annotations

import math

from engine.validation import positive_int


def _check_n(n: int) -> None:
    positive_int("n (number of ranks)", n)


def ring_all_reduce_bytes(size_bytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``size_bytes``: 2(n-1)/n·S."""
    _check_n(n)
    return 2 * (n - 1) / n * size_bytes


def ring_all_reduce_rank_bytes(numel: int, element_bytes: int, n: int, index: int) -> int:
    """Bytes the rank at ``index`` of the ring sends in a ring all-reduce of ``numel``
    elements cut into ``n`` chunks (the first ``numel mod n`` one element longer): in the
    reduce-scatter it sends every chunk but its own (``index``), in the all-gather every chunk
    but the one its left neighbour finished (``index + 1``). The mean over the ranks is
    :func:`ring_all_reduce_bytes`; a rank's own differs when ``n`` does not divide ``numel``
    (a scalar over 4 ranks: 4, 8, 8, 4 B, not 6 B each)."""
    _check_n(n)
    q, r = divmod(numel, n)
    chunk = [q + (1 if i < r else 0) for i in range(n)]
    return element_bytes * (2 * numel - chunk[index % n] - chunk[(index + 1) % n]) \
        if n > 1 else 0


def ring_reduce_scatter_bytes(size_bytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring reduce-scatter of a ``size_bytes`` input."""
    _check_n(n)
    return (n - 1) / n * size_bytes


def ring_all_gather_bytes(size_bytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-gather into a ``size_bytes`` output."""
    _check_n(n)
    return (n - 1) / n * size_bytes


def chain_broadcast_bytes(
    size_bytes: float, n: int, rank: int, root: int = 0
) -> tuple[float, float]:
    """``(sent, received)`` by ``rank`` in a pipelined chain broadcast from ``root``."""
    _check_n(n)
    position = (rank - root) % n  # 0 is the root, n-1 the end of the chain
    sent = size_bytes if position < n - 1 else 0
    received = size_bytes if position > 0 else 0
    return sent, received


def all_to_all_bytes(size_bytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in an all-to-all of ``size_bytes`` split evenly:
    (n-1)/n·S. A rank keeps the 1/n addressed to itself and sends every other piece once
    (pairwise exchange; the collective of expert and Ulysses parallelism)."""
    _check_n(n)
    return (n - 1) / n * size_bytes


def flat_broadcast_bytes(
    size_bytes: float, n: int, rank: int, root: int = 0
) -> tuple[float, float]:
    """``(sent, received)`` when the root sends the whole tensor to each peer in turn."""
    _check_n(n)
    if rank == root:
        return (n - 1) * size_bytes, 0
    return 0, size_bytes


def collective_wire_bytes(
    op: str, size_bytes: int, n: int, rank: int, root: int = 0
) -> tuple[int, int]:
    """The wire model :class:`engine.observe.meter.CommMeter` uses for built-in collectives.

    Returns ``(sent, received)`` for ``rank`` under the bandwidth-optimal ring/chain algorithm.
    ``size_bytes`` is the full tensor: the all-reduce buffer, the reduce-scatter input, the
    all-gather output or the broadcast buffer.
    """
    if op == "all_reduce":
        b = ring_all_reduce_bytes(size_bytes, n)
        sent = received = b
    elif op == "reduce_scatter":
        sent = received = ring_reduce_scatter_bytes(size_bytes, n)
    elif op == "all_gather":
        sent = received = ring_all_gather_bytes(size_bytes, n)
    elif op == "broadcast":
        sent, received = chain_broadcast_bytes(size_bytes, n, rank, root)
    elif op == "reduce":  # a broadcast run backwards: data flows down the chain to the root
        received, sent = chain_broadcast_bytes(size_bytes, n, rank, root)
    elif op == "barrier":
        sent = received = 0
    else:
        raise ValueError(
            f"no wire model for op {op!r}; expected one of all_reduce, reduce_scatter, "
            "all_gather, broadcast, reduce, barrier"
        )
    return round(sent), round(received)


def ps_all_reduce_bytes(size_bytes: float, n: int) -> dict[str, float]:
    """Traffic of an all-reduce through a parameter server that is one of the ``n`` ranks.

    Returns ``{"worker_sent", "worker_received", "server_sent", "server_received"}``: a worker
    moves S each way, the server (n-1)·S each way (Li et al., OSDI 2014). Summed over all
    ranks both the PS and the ring send 2(n-1)·S; the difference is where: the ring spreads it
    evenly, 2(n-1)/n·S per rank, while the server's link carries n-1 times a worker's share.
    """
    _check_n(n)
    worker = size_bytes if n > 1 else 0
    return dict(worker_sent=worker, worker_received=worker,
                server_sent=(n - 1) * size_bytes, server_received=(n - 1) * size_bytes)


def tree_all_reduce_bytes(size_bytes: float, n: int, rank: int) -> tuple[float, float]:
    """``(sent, received)`` by ``rank`` (index in the group) in a binomial-tree all-reduce.

    Each tree edge carries S up (reduce) and S down (broadcast); a rank sends S·(children + 1)
    and receives as much, except the root, which has no parent (engine.comm.tree).
    """
    _check_n(n)
    children, mask = 0, 1
    while mask < n and not rank % (2 * mask):
        children += rank + mask < n
        mask *= 2
    edges = children + (1 if rank else 0)
    return edges * size_bytes, edges * size_bytes


def all_reduce_steps(algorithm: str, n: int) -> int:
    """Sequential message rounds on the critical path: the alpha (latency) term's count."""
    _check_n(n)
    rounds = {"ring": 2 * (n - 1), "ps": 2 * (n - 1),
              "tree": 2 * math.ceil(math.log2(n)) if n > 1 else 0}
    if algorithm not in rounds:
        raise ValueError(f"algorithm must be one of {tuple(rounds)}, got {algorithm!r}")
    return rounds[algorithm]


def all_reduce_critical_bytes(algorithm: str, size_bytes: float, n: int) -> float:
    """Bytes crossing the busiest link in sequence: the beta (bandwidth) term's count.

    ring: 2(n-1)/n·S; tree: S per round, 2·ceil(log2 n) rounds; parameter server: the
    server's link carries (n-1)·S in and (n-1)·S out, one message after another.
    """
    if algorithm == "ring":
        return ring_all_reduce_bytes(size_bytes, n)
    if algorithm == "tree":
        return all_reduce_steps("tree", n) * size_bytes
    if algorithm == "ps":
        return 2 * (n - 1) * size_bytes
    raise ValueError(f"algorithm must be one of ('ring', 'tree', 'ps'), got {algorithm!r}")


def alpha_beta_time(algorithm: str, size_bytes: float, n: int, alpha: float, beta: float) -> float:
    """Predicted seconds: alpha·steps + beta·critical bytes (Hockney's model; Thakur,
    Rabenseifner & Gropp, "Optimization of collective communication operations in MPICH",
    IJHPCA 2005). ``alpha`` in seconds per message, ``beta`` in seconds per byte."""
    return (alpha * all_reduce_steps(algorithm, n)
            + beta * all_reduce_critical_bytes(algorithm, size_bytes, n))


def fit_alpha_beta(samples) -> tuple[float, float]:
    """Least-squares ``(alpha, beta)`` from ``[(algorithm, size_bytes, n, seconds), ...]``."""
    rows, times = [], []
    for algorithm, size, n, seconds in samples:
        rows.append((all_reduce_steps(algorithm, n),
                     all_reduce_critical_bytes(algorithm, size, n)))
        times.append(seconds)
    if len(rows) < 2:
        raise ValueError(f"need at least 2 samples to fit alpha and beta, got {len(rows)}")
    import numpy as np

    a, y = np.array(rows, float), np.array(times, float)
    (alpha, beta), *_ = np.linalg.lstsq(a, y, rcond=None)
    if alpha < 0:  # noise can push a tiny latency below zero: fit the bandwidth term alone
        alpha, beta = 0.0, float(a[:, 1] @ y / (a[:, 1] @ a[:, 1]))
    elif beta < 0:
        alpha, beta = float(a[:, 0] @ y / (a[:, 0] @ a[:, 0])), 0.0
    return float(alpha), float(beta)


_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def bus_bandwidth(op: str, size_bytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth in bytes/s, as nccl-tests reports it (nccl-tests doc/PERFORMANCE.md).

    algbw = S / t; busbw = algbw · factor, with factor 2(n-1)/n for all-reduce, (n-1)/n for
    reduce-scatter and all-gather, 1 for broadcast and reduce. busbw is comparable across n:
    it is the rate at which the busiest link works.
    """
    _check_n(n)
    if op not in _BUS_FACTOR:
        raise ValueError(f"op must be one of {tuple(_BUS_FACTOR)}, got {op!r}")
    if not seconds > 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}")
    return size_bytes / seconds * _BUS_FACTOR[op](n)


# -- gradient compression (chapter 03) -------------------------------------------------------


def topk_kept(numel: int, ratio: float) -> int:
    """Coordinates Top-K keeps of a ``numel`` bucket: ``ceil(ratio * numel)``, at least 1."""
    return max(1, math.ceil(ratio * numel))


def topk_bytes_per_rank(numel: int, ratio: float, n: int, value_bytes: int = 4,
                        index_bytes: int = 4) -> float:
    """Bytes each rank sends for a Top-K exchange by ring all-gather of (values, indices):
    ``(n-1) * k * (value_bytes + index_bytes)``. Unlike a dense all-reduce's
    ``2(n-1)/n * S`` it grows with n, because every rank must receive every other rank's
    choice (Shi et al., "A distributed synchronous SGD algorithm with global Top-k
    sparsification", ICDCS 2019, section III)."""
    _check_n(n)
    return ring_all_gather_bytes(n * topk_kept(numel, ratio) * (value_bytes + index_bytes), n)


def powersgd_elements(shapes, rank: int, min_compression_rate: float = 2) -> tuple[int, int]:
    """``(before, after)``: elements a dense all-reduce would send for gradients of ``shapes``,
    and what PowerSGD sends: ``(n + m) * r`` for each n x m matrix worth compressing, every
    element of the others (Vogels et al., NeurIPS 2019, section 3; PyTorch's rule for "worth
    it": ``(n + m) * r * min_compression_rate < n * m``)."""
    before = after = 0
    for shape in shapes:
        n = shape[0] if len(shape) else 1
        m = math.prod(shape) // n if n else 0
        r = min(n, m, rank)
        before += n * m
        worth = (n + m) * r * min_compression_rate < n * m
        after += (n + m) * r if worth else n * m
    return before, after


# -- ZeRO (chapter 04) ------------------------------------------------------------------------


def zero_model_state_bytes(psi: float, n: int, stage: int, k: float = 12,
                           param_bytes: float = 2, grad_bytes: float = 2) -> dict[str, float]:
    """Model-state bytes per device under ZeRO-DP stage 0-3 (Rajbhandari et al., "ZeRO:
    Memory optimizations toward training trillion parameter models", SC 2020, section 5.1 and
    Figure 1): ``param_bytes * psi`` of parameters, ``grad_bytes * psi`` of gradients and
    ``k * psi`` of optimizer state. Mixed-precision Adam is the paper's 2 + 2 + 12 (fp16
    parameters and gradients; fp32 master weights, momentum and variance); plain fp32 Adam is
    ``param_bytes=4, grad_bytes=4, k=8``. Stage 1 divides the optimizer state by ``n``, stage
    2 the gradients too, stage 3 the parameters too."""
    _check_n(n)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    params, grads, optim = param_bytes * psi, grad_bytes * psi, k * psi
    if stage >= 1:
        optim /= n
    if stage >= 2:
        grads /= n
    if stage >= 3:
        params /= n
    return {"params": params, "grads": grads, "optimizer": optim,
            "total": params + grads + optim}


def zero_comm_elements(psi: float, n: int, stage: int) -> float:
    """Elements each rank sends per step (ZeRO paper, section 7): stages 0-2 move gradients
    and parameters once each, ``2(n-1)/n * psi`` (all-reduce, or reduce-scatter + all-gather);
    stage 3 gathers the parameters twice (forward and backward) and reduce-scatters the
    gradients, ``3(n-1)/n * psi``: 1.5x data parallelism."""
    _check_n(n)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    return (3 if stage == 3 else 2) * (n - 1) / n * psi


def transformer_activation_bytes(layers: int, hidden: int, heads: int, seq_len: int,
                                 micro_batch: int = 1, checkpoint: bool = False) -> float:
    """Activation bytes one GPU keeps for backward, 16-bit activations, no tensor or sequence
    parallelism (Korthikanti et al., "Reducing activation recomputation in large transformer
    models", MLSys 2023, equation 1): ``s*b*h*(34 + 5*a*s/h)`` per layer. With full activation
    checkpointing only each layer's 16-bit input is kept: ``2*s*b*h`` per layer (section 5)."""
    s, b, h, a = seq_len, micro_batch, hidden, heads
    per_layer = 2 * s * b * h if checkpoint else s * b * h * (34 + 5 * a * s / h)
    return layers * per_layer


# -- tensor parallelism (chapter 05) ----------------------------------------------------------


def tp_comm_elements_per_layer(b: int, s: int, h: int, t: int) -> float:
    """Elements each rank sends per transformer layer per micro-batch under Megatron tensor
    parallelism of degree ``t``: four ring all-reduces (two forward, two backward) of
    ``b*s*h`` activations each, ``4 * 2(t-1)/t * bsh = 8bsh(t-1)/t`` (Shoeybi et al. 2019,
    section 3; Narayanan et al., SC 2021, section 3.2)."""
    _check_n(t)
    return 8 * b * s * h * (t - 1) / t


def zero3_comm_elements_per_layer(h: int, t: int) -> float:
    """The same for ZeRO-3 over ``t`` ranks, per layer per step: ``3(t-1)/t`` times the
    layer's ``12h^2`` parameters (two all-gathers and one reduce-scatter), independent of the
    batch (Rajbhandari et al. 2020, section 7)."""
    _check_n(t)
    return 3 * (t - 1) / t * 12 * h * h


# -- pipeline parallelism (chapter 06) ----------------------------------------------------------


def bubble_fraction(p: int, m: int, v: int = 1, relative_to: str = "total") -> float:
    """Pipeline bubble with ``p`` stages, ``m`` micro-batches and ``v`` chunks per stage,
    uniform stages, no communication time. Two definitions, both in use:

    * ``relative_to="total"``: idle share of the whole run, ``(p-1) / (v*m + p - 1)``
      (GPipe, Huang et al. 2019, section 2.3, with v = 1);
    * ``relative_to="ideal"``: idle time over the ideal (busy) time, ``(p-1) / (v*m)``
      (Megatron-LM, Narayanan et al. 2021, section 2.2).

    1F1B has the same bubble as GPipe; interleaving divides it by ``v``."""
    _check_n(p)
    positive_int("m", m)
    positive_int("v", v)
    if relative_to == "total":
        return (p - 1) / (v * m + p - 1)
    if relative_to == "ideal":
        return (p - 1) / (v * m)
    raise ValueError(f"relative_to must be 'total' or 'ideal', got {relative_to!r}")


# -- zero-bubble pipelines (chapter 06): the backward split into B (input) and W (weights) -------


def _stage_times(t_f: float, t_b: float, t_w: float) -> None:
    from engine.validation import non_negative_number, positive_number

    positive_number("t_f", t_f)
    positive_number("t_b", t_b)
    non_negative_number("t_w", t_w)


def one_f_one_b_bubble_time(p: int, t_f: float, t_b: float, t_w: float = 0.0) -> float:
    """Idle time of each stage under GPipe or 1F1B: ``(p-1)(T_F + T_B + T_W)``, the warm-up
    and cool-down of ``p-1`` forward and *full* backward slots (the full backward is the input
    gradient ``T_B`` plus the weight gradient ``T_W``; Qi et al., "Zero Bubble Pipeline
    Parallelism", ICLR 2024, section 2.1). With ``t_w = 0``, ``t_b`` is the whole backward."""
    _check_n(p)
    _stage_times(t_f, t_b, t_w)
    return (p - 1) * (t_f + t_b + t_w)


def zb_h1_bubble_time(p: int, t_f: float, t_b: float, t_w: float, b: str = "input") -> float:
    """Idle time of each stage under ZB-H1 (Qi et al., ICLR 2024, section 2.1, Figure 3):
    ``(p-1)(T_F + T_B - T_W)`` where ``T_B`` is the *input* gradient alone (``b="input"``, the
    paper's B). The DualPipe README (deepseek-ai/DualPipe, its row "ZB1P") writes
    ``(PP-1)(F + B - 2W)`` where B is the *full* backward, input and weights (``b="full"``):
    the same number, since ``B_full = T_B + T_W``. Exact when ``m >= p`` and
    ``T_W <= T_F, T_B`` (the simulator's ZB-H1 matches it there); other times are refused."""
    from engine.validation import one_of

    one_of("b", b, ("input", "full"))
    t_input = t_b - t_w if b == "full" else t_b
    _check_n(p)
    _stage_times(t_f, t_input, t_w)
    if t_w > min(t_f, t_input):
        raise ValueError(f"the ZB-H1 formula holds for T_W <= T_F and T_W <= T_B (input "
                         f"gradient); got T_F={t_f}, T_B={t_input}, T_W={t_w}")
    return (p - 1) * (t_f + t_input - t_w)


def zb_h1_bubble_fraction(p: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """ZB-H1's idle share of the total time: ``(p-1)(T_F+T_B-T_W)`` over
    ``m(T_F+T_B+T_W) + (p-1)(T_F+T_B-T_W)``, with ``T_B`` the input gradient alone."""
    from engine.validation import positive_int

    positive_int("m", m)
    idle = zb_h1_bubble_time(p, t_f, t_b, t_w)
    return idle / (m * (t_f + t_b + t_w) + idle)


def zb_h2_bubble_time(p: int, t_f: float, t_b: float, t_w: float) -> float:
    """Idle time of each stage under ZB-H2 (Qi et al., ICLR 2024, section 2.2, "Zero bubble
    schedule", and the paper's table of bubble and peak memory per schedule): ``(p-1)(T_F + T_B - 2T_W)``,
    ``T_B`` the input gradient alone; zero when ``T_F = T_B = T_W``. Derivation: stage ``s``
    receives its first B after ``2(p-1-s)+1`` slots and fills them with forwards; in the tail
    the last B's reach stage 0 one B per stage late, and stage ``s`` fills the ``2s`` slots by
    running its W's ``2s`` backwards late. What is left per stage, measured within the stage's
    own span (its first forward to its last W) or per step when steps follow each other with
    no synchronised optimizer step (section 4, post-validation): ``p-1`` times the mismatch
    ``T_F + T_B - 2T_W``. Exact (the simulator's :func:`engine.pp.zero_bubble.zb_h2` matches
    it) when ``m >= 2p-1`` and ``T_W <= T_F, T_B``; other times are refused."""
    _check_n(p)
    _stage_times(t_f, t_b, t_w)
    if t_w > min(t_f, t_b):
        raise ValueError(f"the ZB-H2 formula holds for T_W <= T_F and T_W <= T_B (input "
                         f"gradient); got T_F={t_f}, T_B={t_b}, T_W={t_w}")
    return (p - 1) * (t_f + t_b - 2 * t_w)


# Peak activations on the busiest pipeline rank, in M_B: one micro-batch's activations for
# the rank's whole share of the model (both chunks of a V schedule together); the source of each.
PEAK_ACTIVATIONS = {
    "1f1b": ("p", "Narayanan et al. 2021 (PipeDream-Flush): p warm-up micro-batches on stage 0"),
    "zb_h1": ("p", "Qi et al. 2024, ZB-H1: 1F1B's count on stage 0; holds when W keeps less "
                   "than B (their Table 1: 32sbh against 34sbh + 5as^2b per layer)"),
    "zb_h2": ("2p-1", "Qi et al. 2024, ZB-H2: 2p-1 warm-up forwards on stage 0"),
    "zb_v": ("p", "Qi et al. 2024, section 6 (ZB-V): 2p chunk micro-batches of half a stage, "
                  "1F1B's amount, on every rank"),
    "dualpipe_v": ("p+1/2", "deepseek-ai/DualPipe README: PP+1 chunk micro-batches per device "
                            "for PP = 2p chunk stages"),
}


def pipeline_peak_activations(schedule: str, p: int) -> float:
    """Peak activations of the busiest rank (stage 0) under ``schedule`` (a key of
    :data:`PEAK_ACTIVATIONS`), in units of ``M_B`` (see there): ``p`` for 1F1B, ZB-H1 and
    ZB-V, ``2p-1`` for ZB-H2, ``p + 1/2`` for DualPipeV. Counted as micro-batches between F
    and B; a split backward's W-stash (each linear layer's input and output gradient, held
    from B to W) comes on top."""
    from engine.validation import one_of

    one_of("schedule", schedule, tuple(PEAK_ACTIVATIONS))
    _check_n(p)
    return {"1f1b": p, "zb_h1": p, "zb_h2": 2 * p - 1, "zb_v": p,
            "dualpipe_v": p + 0.5}[schedule]


def pipeline_p2p_hops(schedule: str, p: int, v: int = 2) -> int:
    """Point-to-point messages between ranks per micro-batch per step: one activation forward
    and one gradient backward at every boundary between two virtual stages on different
    ranks. One chunk per rank (1F1B, ZB-H1, ZB-H2): ``2(p-1)``. A V (ZB-V, DualPipeV): ``2p``
    virtual stages, whose middle boundary stays on rank ``p-1``: ``2(2p-2) = 4(p-1)``, twice
    as many. Interleaved with ``v`` chunks: ``2(vp-1)``."""
    from engine.validation import one_of

    one_of("schedule", schedule, ("gpipe", "1f1b", "zb_h1", "zb_h2", "zb_v", "dualpipe_v",
                                  "interleaved"))
    _check_n(p)
    if schedule in ("zb_v", "dualpipe_v"):
        return 4 * (p - 1)
    if schedule == "interleaved":
        positive_int("v", v)
        return 2 * (v * p - 1)
    return 2 * (p - 1)


# -- model size, compute and time at scale (chapters 07-08) -------------------------------------


def transformer_params(layers: int, hidden: int, vocab: int = 51200, seq_len: int = 2048
                       ) -> float:
    """Parameters of a GPT-style transformer (Narayanan et al., "Efficient large-scale language
    model training on GPU clusters using Megatron-LM", SC 2021, equation 2):
    ``12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))``. GPT-3 (l=96, h=12288): 174.6 B."""
    n_layers, h = layers, hidden
    return 12 * n_layers * h * h * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * n_layers * h))


def transformer_flops(batch: int, seq_len: int, layers: int, hidden: int, vocab: int = 51200,
                      recompute: bool = True) -> float:
    """Floating-point operations of one training step on ``batch`` sequences (same paper,
    equation 3): ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` with full activation recomputation
    (one extra forward pass); ``72 ...`` without it."""
    s, n_layers, h = seq_len, layers, hidden
    return (96 if recompute else 72) * batch * s * n_layers * h * h * (
        1 + s / (6 * h) + vocab / (16 * n_layers * h))


def training_days(tokens: float, params: float, gpus: int, flops_per_gpu: float,
                  recompute: bool = True) -> float:
    """End-to-end training time in days (same paper, equation 4): ``8 T P / (n X)`` seconds
    with recomputation (``6 T P / (n X)`` without), for ``T`` tokens, ``P`` parameters, ``n``
    GPUs each sustaining ``X`` FLOP/s. GPT-3: 300 B tokens on 1024 GPUs at 140 TFLOP/s, about
    34 days."""
    return (8 if recompute else 6) * tokens * params / (gpus * flops_per_gpu) / 86400


def tp_activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int,
                                  tp: int = 1, recompute: bool = False) -> float:
    """Activation bytes per transformer layer per GPU with tensor parallelism ``tp`` and no
    sequence parallelism (Korthikanti et al., MLSys 2023, equation 2 and section 4.2):
    ``s b h (10 + 24/t + 5 a s / (h t))``; with full recomputation only the layer input,
    ``2 s b h``."""
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    if recompute:
        return 2 * s * b * h
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


# -- long sequences: sequence and context parallelism (chapter 09) -------------------------------


def sp_activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int,
                                  tp: int = 1) -> float:
    """Activation bytes per layer per GPU with tensor *and* sequence parallelism ``tp``
    (Korthikanti et al., MLSys 2023, section 4.2.2): ``s b h / t (34 + 5 a s / h)``. Against
    equation 2 (:func:`tp_activation_bytes_per_layer`) the ``10 s b h`` that tensor parallelism
    leaves replicated (LayerNorm and dropout regions, and the inputs of the first linear of
    attention and MLP) is divided by ``t`` too."""
    _check_n(tp)
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
    _check_n(cp)
    _check_n(tp)
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
    _check_n(t)
    return 10 * b * s * h * (t - 1) / t


def ring_attention_bytes(seq: int, kv_hidden: int, n: int, dtype_bytes: float = 2
                         ) -> dict[str, float]:
    """Bytes each rank sends (and receives) per attention layer in ring attention over ``n``
    ranks (Liu et al., "Ring attention", 2023): ``seq`` tokens in all (batch x sequence),
    ``kv_hidden`` = KV heads x head_dim. Forward: N-1 steps, each passing one ``S/N``-token K
    and V block on, ``2 (N-1) (S/N) kv_hidden``. Backward: the K/V blocks again and the dK/dV
    accumulators, twice the forward. Close to ``2 S kv_hidden`` forward whatever N."""
    _check_n(n)
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
    _check_n(n)
    kv = hidden if kv_hidden is None else kv_hidden
    forward = all_to_all_bytes(seq / n * (2 * hidden + 2 * kv) * dtype_bytes, n)
    return {"forward": forward, "backward": forward, "total": 2 * forward}


def ulysses_sent_kv_heads(heads: int, kv_heads: int, n: int) -> int:
    """KV heads that travel in Ulysses over ``n`` ranks: ``lcm(kv_heads, n)``. ``n`` must
    divide the query heads (a rank takes whole query heads); when it does not divide
    ``kv_heads`` each KV head is replicated ``lcm / kv_heads`` times so that every rank gets
    the KV heads of its query heads (``kv_heads`` itself when ``n`` divides it)."""
    _check_n(n)
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
    _check_n(n)
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
    _check_n(n)
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
    _check_n(n)
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
    _check_n(n)
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


# -- mixture of experts (chapter 10) ------------------------------------------------------------


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

# -- chapter 11: training across slow links and failures --------------------------------------

def diloco_syncs(steps: int, sync_every: int, fragments: int = 1) -> list[int]:
    """How many syncs each fragment starts in ``steps`` inner steps of streaming DiLoCo
    (Douillard et al., 2025, section 2.2): fragment ``p`` syncs at the steps
    ``t ≡ (p+1)·H/F (mod H)``, ``1 <= t <= steps``; ``F = 1`` is DiLoCo's every ``H`` steps
    (Douillard et al., 2023, Algorithm 1)."""
    positive_int("sync_every", sync_every)
    positive_int("fragments", fragments)
    stagger = sync_every // fragments
    counts = []
    for p in range(fragments):
        first = (p + 1) * stagger  # the first step t >= 1 with t ≡ offset (mod H)
        counts.append(0 if steps < first else (steps - first) // sync_every + 1)
    return counts


def diloco_bytes(numel: int, steps: int, sync_every: int, n: int, dtype_bytes: float = 4,
                 fragments: int = 1) -> float:
    """Bytes each replica sends in ``steps`` inner steps of (streaming) DiLoCo: every sync of a
    fragment of ``numel / F`` elements is one ring all-reduce of its pseudo-gradient,
    ``2(n-1)/n · numel/F · dtype_bytes`` (Douillard et al., 2023, Algorithm 1; 2025 for the
    fragments). Data parallelism sends ``2(n-1)/n · numel · 4`` every step: DiLoCo cuts it by
    ``H`` (and by 2 more with a bf16 outer all-reduce)."""
    return sum(diloco_syncs(steps, sync_every, fragments)) * \
        diloco_peak_sync_bytes(numel, n, dtype_bytes, fragments)


def diloco_peak_sync_bytes(numel: int, n: int, dtype_bytes: float = 4,
                           fragments: int = 1) -> float:
    """Bytes one replica sends in one sync: ``2(n-1)/n · numel/F · dtype_bytes``. Streaming
    DiLoCo's point (Douillard et al., 2025, section 2.2): the peak bandwidth falls by ``F``."""
    positive_int("fragments", fragments)
    return ring_all_reduce_bytes(numel / fragments * dtype_bytes, n)


def hsdp_replica_bytes(numel: int, shard: int, replicas: int, dtype_bytes: float = 4) -> float:
    """Bytes each rank sends across the replica dimension per step in HSDP (hybrid sharding:
    ZeRO-3 inside a group of ``shard`` ranks, replicated over ``replicas`` groups; Zhao et al.,
    "PyTorch FSDP", VLDB 2023, section 3.2.2): each rank all-reduces only its reduce-scattered
    shard, ``2(R-1)/R · numel/S · dtype_bytes``, the ``S``-th of what data parallelism sends
    across the same links (``2(R-1)/R · numel · dtype_bytes``). The paper gives the cross-host
    traffic per GPU as ``2M(W-1)/(GW)`` for ``M`` bytes of model on ``W`` GPUs in hosts of
    ``G``; with ``M = numel · dtype_bytes``, ``W = R·S`` and ``G = S`` the ring over the ``R``
    replicas counted here is ``2M(W-S)/(SW)``, a little less, and the two meet as ``W/S``
    grows."""
    positive_int("shard", shard)
    return ring_all_reduce_bytes(numel / shard * dtype_bytes, replicas)


def young_checkpoint_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """The compute time between checkpoints that wastes the least, to first order:
    ``sqrt(2·C·M)`` for a checkpoint that costs ``C`` seconds and failures ``M`` seconds apart
    on average (Young, "A first order approximation to the optimum checkpoint interval",
    CACM 17(9), 1974). The waste per second is about ``C/T + T/(2M)``: the checkpoints, and
    half an interval of lost work per failure."""
    from engine.validation import positive_number
    positive_number("checkpoint_s", checkpoint_s)
    positive_number("mtbf_s", mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def checkpoint_waste(interval_s: float, checkpoint_s: float, mtbf_s: float) -> float:
    """The first-order share of wall time wasted when checkpointing every ``interval_s``
    seconds of compute (Young, 1974): ``C/T`` writing checkpoints plus ``T/(2M)``, the half
    interval of work lost per failure on average. Least at ``T = sqrt(2CM)``
    (:func:`young_checkpoint_interval`), where it is ``sqrt(2C/M)``."""
    from engine.validation import positive_number
    positive_number("interval_s", interval_s)
    positive_number("checkpoint_s", checkpoint_s)
    positive_number("mtbf_s", mtbf_s)
    return checkpoint_s / interval_s + interval_s / (2 * mtbf_s)


def daly_checkpoint_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (Daly, "A higher order estimate of the optimum checkpoint
    interval for restart dumps", FGCS 22(3), 2006, eq. 37): for ``C < 2M``,
    ``sqrt(2CM)·(1 + sqrt(C/2M)/3 + (C/2M)/9) - C``; else ``M``."""
    young = young_checkpoint_interval(checkpoint_s, mtbf_s)
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2 * mtbf_s)
    return young * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_s


# -- chapter 12: precision and memory -----------------------------------------------------------


def mixed_precision_bytes_per_parameter(low_bytes: int = 2, master_gradient: bool = True,
                                        optimizer_bytes: int = 8) -> int:
    """Bytes per parameter of mixed-precision training with Adam (Micikevicius et al., "Mixed
    Precision Training", ICLR 2018): the fp32 master (4), the ``low_bytes`` working copy and
    its gradient, the fp32 gradient the optimizer reads (4; ``master_gradient=False`` when the
    update reads the low-precision gradient, the ZeRO paper's 2 + 2 + 12 = 16) and Adam's two
    fp32 moments (``optimizer_bytes`` = 8)."""
    return 4 + 2 * low_bytes + (4 if master_gradient else 0) + optimizer_bytes


def loss_scale_after(found_inf, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                     backoff_factor: float = 0.5, growth_interval: int = 2000
                     ) -> tuple[float, int, int]:
    """``(scale, clean steps counted, steps skipped)`` after dynamic loss scaling sees the
    ``found_inf`` flags in order (Micikevicius et al. 2018, section 3.2; ``torch.amp.GradScaler``'s
    rule): an inf/NaN step is skipped, the scale times ``backoff_factor``, the count reset; a
    clean step counts, and the ``growth_interval``-th in a row multiplies the scale by
    ``growth_factor`` (unless that overflows fp32) and resets the count."""
    scale, clean, skipped = float(init_scale), 0, 0
    for inf in found_inf:
        if inf:
            scale, clean, skipped = scale * backoff_factor, 0, skipped + 1
            continue
        clean += 1
        if clean == growth_interval:
            if scale * growth_factor <= 3.4028234663852886e38:  # torch.finfo(float32).max
                scale *= growth_factor
            clean = 0
    return scale, clean, skipped


def dim0_padding_rows(rows: int, n: int) -> int:
    """Rows of zeros FSDP2 pads a parameter of ``rows`` rows with on dim 0 over ``n`` ranks:
    ``ceil(rows / n) * n - rows`` (every rank's chunk ``ceil(rows / n)`` rows in the collectives;
    the local shard itself is not padded)."""
    _check_n(n)
    return -(-rows // n) * n - rows


def fp8_all_gather_bytes(shard_numel: int, n: int, element_bytes: float = 1,
                         scale_bytes: float = 4) -> float:
    """Bytes each rank sends in an all-gather of its ``shard_numel``-element shard cast to FP8
    (``element_bytes`` = 1) with its own fp32 scale gathered beside it (one scale per shard,
    this engine's variant): ``(n-1) (numel + 4)``; bf16's is ``(n-1) 2 numel``
    (``element_bytes=2, scale_bytes=0``). torchao's float8 all-gather for FSDP2 keeps one scale
    per weight instead: ``scale_bytes=0`` here, plus the all-reduce of the amax before the cast
    (:func:`ring_all_reduce_rank_bytes` of one fp32 element)."""
    _check_n(n)
    return (n - 1) * (shard_numel * element_bytes + scale_bytes)


def fp8_scale_count(m: int, k: int, n: int, tile: int = 128) -> int:
    """fp32 scales kept for an ``M x K`` activation in ``1 x tile`` tiles and a ``K x N``
    weight in ``tile x tile`` blocks (DeepSeek-V3 Technical Report, section 3.3.2):
    ``M K / tile + (K / tile)(N / tile)``."""
    for name, value in (("m", m), ("k", k), ("n", n)):
        positive_int(name, value)
    if k % tile or n % tile:
        raise ValueError(f"tile={tile} does not divide k={k} and n={n}")
    return m * k // tile + (k // tile) * (n // tile)


def muon_newton_schulz_flops(rows: int, cols: int, steps: int = 5) -> int:
    """Matmul FLOPs of Muon's quintic Newton-Schulz on a ``rows x cols`` matrix (Jordan et al.,
    "Muon", 2024), the smaller Gram matrix formed (``m = min``, ``n = max``): per step
    ``X X^T`` (``2 m^2 n``), its square (``2 m^3``) and the product with ``X`` (``2 m^2 n``)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


MUON_SCHEMES = ("owner", "gather")


def muon_step_bytes(scheme: str, psi: int, n: int, largest_owned: int = 0,
                    element_bytes: int = 4) -> int:
    """Bytes each rank sends (ring collectives) in one step of distributed Muon over ``n``
    data-parallel ranks, ``psi`` matrix elements in all:

    * ``"owner"``, each matrix owned by one rank (Keller Jordan's reference implementation,
      Essential AI's; :class:`engine.optim.DistributedMuon`): the gradients reduce-scattered to
      the owners and the new matrices all-gathered, every rank's segment padded to the largest
      owner's ``largest_owned`` elements: ``2 (n-1) largest_owned``;
    * ``"gather"``, Moonlight's Algorithm 1 (Liu et al., "Muon is Scalable for LLM Training",
      2025, section 2.3; :class:`engine.optim.GatherMuon`): ZeRO-1's even slices of
      ``ceil(psi / n)`` elements, the gradients reduce-scattered, the momentum-updated slices
      all-gathered (every rank then holds every matrix) and the new parameters all-gathered:
      ``3 (n-1) ceil(psi / n)``.

    Times ``element_bytes``."""
    _check_n(n)
    if scheme == "owner":
        if not 0 < largest_owned <= psi:
            raise ValueError(f"largest_owned={largest_owned!r}: the elements of the most "
                             f"loaded owner, in (0, psi={psi}]")
        return 2 * (n - 1) * largest_owned * element_bytes
    if scheme == "gather":
        return 3 * (n - 1) * -(-psi // n) * element_bytes
    raise ValueError(f"scheme={scheme!r}; expected one of {MUON_SCHEMES}")


def muon_ns_flops_per_rank(scheme: str, shapes, owned=(), steps: int = 5) -> int:
    """Newton-Schulz FLOPs one rank runs in one distributed Muon step over the matrices of
    ``shapes`` ((rows, cols) each): ``"gather"`` (Moonlight's Algorithm 1) every matrix on every
    rank, so ``n`` times one process's work in all; ``"owner"`` only the matrices ``owned``
    (indices into ``shapes``), so each matrix once over the ranks. Each matrix
    :func:`muon_newton_schulz_flops`."""
    if scheme not in MUON_SCHEMES:
        raise ValueError(f"scheme={scheme!r}; expected one of {MUON_SCHEMES}")
    mine = range(len(shapes)) if scheme == "gather" else owned
    return sum(muon_newton_schulz_flops(*shapes[i], steps) for i in mine)


def recompute_activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int,
                                         heads: int, policy: str = "none", tp: int = 1) -> float:
    """Activation bytes per transformer layer kept for backward under a recomputation
    ``policy``, with tensor and sequence parallelism ``tp`` (Korthikanti et al., "Reducing
    activation recomputation in large transformer models", MLSys 2023, sections 4.2.2 and 5,
    Table 2): ``"none"`` ``34 s b h / t + 5 a s^2 b / t``; ``"selective"`` (recompute only the
    attention core: ``Q K^T``, softmax, its dropout, attention over values) ``34 s b h / t``;
    ``"full"`` (keep only the layer's 16-bit input) ``2 s b h / t``. For ``"full"`` Table 2
    gives ``2 s b h``, undivided; ``/ t`` is Megatron-LM's implementation with sequence
    parallelism, which checkpoints each rank's ``s / t`` shard of the input (an assumption
    beyond the table; equal to it at ``tp = 1``)."""
    _check_n(tp)
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    kept = {"none": 34 * s * b * h + 5 * a * s * s * b, "selective": 34 * s * b * h,
            "full": 2 * s * b * h}
    if policy not in kept:
        raise ValueError(f"policy={policy!r}; expected one of {tuple(kept)}")
    return kept[policy] / t
