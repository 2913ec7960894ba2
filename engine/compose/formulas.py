"""The bytes each kind of group (dp, cp, ep, tp, pp) of a composed layout must carry, by formula,
per rank, for the counted steps: what :mod:`engine.compose.traffic` counts on the wire.

Every formula is the sum of the collectives the layers issue, each at the ring's cost
(:func:`engine.theory.ring_all_reduce_bytes`: ``2(n-1)/n S`` for an all-reduce, half that for
a reduce-scatter or an all-gather; :func:`engine.theory.all_to_all_bytes`: ``(n-1)/n S``).
``b`` is the rows of one micro-batch on a rank (global rows / (dp x m)), ``s`` the tokens a
context-parallel rank holds of a sequence, ``h`` the hidden size, ``t`` the tensor-parallel
degree, ``m`` the micro-batches, 4 B an fp32 element.

* **tp** (Shoeybi et al. 2019, section 3): per micro-batch and layer two all-reduces of ``bsh``
  forward (attention's and the MLP's row-parallel outputs) and two backward (their column-
  parallel inputs), :func:`engine.theory.tp_comm_elements_per_layer`; an MoE layer's experts are
  not split, so only attention's two. Plus the vocab-parallel embedding's forward all-reduce
  (first stage), the output layer's backward one and the vocab-parallel loss's three of ``bs``
  numbers (max, sum of exponentials, target logit; last stage). With sequence parallelism
  (Korthikanti et al. 2023, section 4.2.2) each all-reduce is a reduce-scatter and an all-gather
  and each column-parallel layer gathers its input once more in backward,
  :func:`engine.theory.sp_comm_elements_per_layer` (``10 bsh (t-1)/t`` a layer); the embedding
  sends ``2 bsh (t-1)/t`` and the gradient of its positions' gather ``sh (t-1)/t``, the output
  layer ``3 bsh (t-1)/t``, and every LayerNorm weight and bias and every row-parallel bias
  (their tokens are split) is all-reduced in backward, ``2h (t-1)/t`` each.
* **cp**: ring attention (Liu et al. 2023) sends ``N-1`` K/V blocks forward and the K/V blocks
  and their gradients backward, :func:`engine.theory.ring_attention_bytes`; Ulysses (Jacobs et
  al. 2023) four all-to-alls each way, :func:`engine.theory.ulysses_bytes`; per micro-batch and
  layer, over the ``b x seq_len`` tokens of the sequence and this rank's ``1/t`` of the heads.
* **ep** (GShard, Lepikhin et al. 2021): per micro-batch and MoE layer an all-to-all of the
  ``E`` token counts (int64), then dispatch and combine forward and the same two backward. Their
  bytes depend on the routing, so the formula takes it as input: ``crossing_rows``, the (token,
  expert) rows this rank sent to experts on other ranks, counted by the router (what the layer
  decided, not what the wire carried). ``4 x crossing_rows x h x 4 B`` is exact summed over the
  ranks (every row crosses four times); one rank sends its own rows out twice and other ranks'
  rows back twice, so per rank it is exact only when as many rows come in as go out. Plus the
  experts' gradients over ``mesh.expert_dp_group``, as dp below.
* **pp**: per micro-batch, the activation of ``b x s x h`` forward and its gradient backward
  over each boundary between virtual stages on two ranks, plus a shape header of
  :data:`engine.pp.link.SHAPE_HEADER_BYTES` per step and forward boundary; the tied embedding's
  gradient all-reduced over the first and the last stage (``V/t x h``, when they are two
  ranks); the step's loss (4 B) broadcast from the rank holding the last stage down a chain
  (``pp - 1`` messages, written on the holder: exact summed over the ranks).
* **dp** (over dp x cp; Rajbhandari et al. 2020): with ``A`` an all-reduce of this rank's
  (padded) dense parameter bytes, DDP and ZeRO-1 send one ``A`` a step (gradients accumulate
  locally; ZeRO-1 a reduce-scatter and an all-gather), ZeRO-2 a reduce-scatter per micro-batch
  and one all-gather, ``(m + 1) A / 2`` (in a pipeline one all-gather more on the stages holding
  the tied embedding: :func:`engine.compose.pipeline.sum_tied_embedding` gathers its bucket),
  ZeRO-3 (:mod:`engine.fsdp`, ``A`` over its groups' padded chunks) two all-gathers and a
  reduce-scatter of every group per micro-batch, ``3 A / 2``, less one all-gather of the root
  group, kept from forward to backward (in a pipeline the root, held for the step, is
  gathered and reduce-scattered once a step; every other group is reduce-scattered once per
  micro-batch, at its B, or under a schedule with W actions at its W); plus the step's loss,
  an all-reduce of 4 B. A ring over n ranks cuts a tensor into n chunks; when n does not divide
  it the chunks differ and so do the ranks' bytes, but every chunk still travels ``2(n-1)``
  times: summed over the group the formula is exact. Compressed DDP: :func:`compressed_dp_formula`.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

from engine import theory
from engine.comm import ops
from engine.compose.experts import balance_bytes
from engine.compose.model import Block
from engine.compose.pipeline import chunk_layout, chunks_per_rank, loss_stage, tied_across_ranks
from engine.compose.plan import Plan, usp_degrees
from engine.pp import schedule_spec
from engine.pp.actions import virtual_stages
from engine.pp.link import SHAPE_HEADER_BYTES
from engine.topology import Mesh

FP32 = 4


class Formula(NamedTuple):
    """What a formula predicts (bytes) and how it is written out."""

    bytes: float
    text: str


def counted(steps: int) -> str:
    return f"{steps} step{'s' if steps != 1 else ''}"


def layers_held(gpt: nn.Module) -> tuple[int, int]:
    """``(layers, dense layers)`` this rank runs (a pipeline stage's others are Identity)."""
    blocks = [b for b in gpt.blocks if isinstance(b, Block)]
    return len(blocks), sum(b.moe is None for b in blocks)


def tp_formula(gpt, plan: Plan, b: int, steps: int) -> Formula:
    """Bytes over ``mesh.tp_group`` (module docstring)."""
    cfg, t, m = gpt.cfg, plan.tp, plan.micro_batches
    s, h, r = cfg.seq_len // plan.cp, cfg.hidden, (plan.tp - 1) / plan.tp
    layers, dense = layers_held(gpt)
    first, last = gpt.tok is not None, gpt.head is not None
    if plan.sequence_parallel:
        lns = 2 * layers + last
        norm_vectors = 1 if cfg.norm == "rmsnorm" else 2  # RMSNorm: a gain, no bias
        positions = first and gpt.pos is not None  # learned ones: scattered as the tokens
        biases = sum(blk.attn.proj.bias is not None for blk in gpt.blocks if isinstance(
            blk, Block)) + sum(blk.out.bias is not None for blk in gpt.blocks
                               if isinstance(blk, Block) and blk.moe is None)
        per_mb = dense * theory.sp_comm_elements_per_layer(b, s, h, t) + \
            (layers - dense) * (theory.sp_comm_elements_per_layer(b, s, h, t) / 2 +
                                2 * r * b * s * h) + \
            first * 2 * r * b * s * h + positions * r * s * h + last * 3 * r * b * s * h + \
            (norm_vectors * lns + biases) * 2 * r * h
        text = (f"10bsh(t-1)/t x {dense} dense layers (theory.sp_comm_elements_per_layer)"
                + (f" + (5 + 2)bsh(t-1)/t x {layers - dense} MoE layers (the attention's, "
                   "and the whole sequence gathered in, its gradient gathered back: "
                   "experts.sequence_parallel_experts)" if layers > dense else "")
                + (" + embedding 2bsh(t-1)/t" if first else "")
                + (" + positions sh(t-1)/t" if positions else "")
                + (" + output layer 3bsh(t-1)/t" if last else "")
                + f" + {norm_vectors * lns + biases} norm/row-bias gradients x 2h(t-1)/t")
    else:
        per_mb = dense * theory.tp_comm_elements_per_layer(b, s, h, t) + \
            (layers - dense) * theory.tp_comm_elements_per_layer(b, s, h, t) / 2 + \
            (first + last) * theory.ring_all_reduce_bytes(b * s * h, t)
        text = (f"8bsh(t-1)/t x {dense} dense layers (theory.tp_comm_elements_per_layer)"
                + (f" + 4bsh(t-1)/t x {layers - dense} MoE layers" if layers > dense else "")
                + (" + embedding 2bsh(t-1)/t" if first else "")
                + (" + output layer 2bsh(t-1)/t" if last else ""))
    per_mb += last * 3 * theory.ring_all_reduce_bytes(b * s, t)
    text += " + loss 3 x 2bs(t-1)/t" if last else ""
    return Formula(steps * m * per_mb * FP32, f"{counted(steps)} x m x ({text}) x 4 B; b = {b}, "
                   f"s = {s}, h = {h}, t = {t}, m = {m}")


def cp_formula(gpt, plan: Plan, b: int, steps: int) -> Formula:
    """Bytes over ``mesh.cp_group``: ring attention's K/V blocks or Ulysses' all-to-alls."""
    cfg, n, m = gpt.cfg, plan.cp, plan.micro_batches
    layers, _ = layers_held(gpt)
    tokens, kv = b * cfg.seq_len, cfg.kv_heads_or_heads * cfg.head_dim // plan.tp
    usp = usp_degrees(plan.cp_method)
    if plan.cp_method == "ulysses":
        per = theory.ulysses_bytes(tokens, cfg.hidden // plan.tp, n, FP32, kv)["total"]
        text = "Ulysses: 2 x (N-1)/N^2 S (2 h/t + 2 kv_hidden) x 4 B (theory.ulysses_bytes)"
    elif usp:  # Ulysses over U inside, ring over R across (engine.compose.usp)
        per = theory.usp_bytes(tokens, cfg.heads // plan.tp, kv // cfg.head_dim, cfg.head_dim,
                               usp[0], usp[1], FP32)["total"]
        text = f"USP: Ulysses over U = {usp[0]} + ring over R = {usp[1]} (theory.usp_bytes)"
    elif plan.cp_method == "allgather":  # K/V gathered twice, dK/dV reduce-scattered
        per = theory.ring_attention_bytes(tokens, kv, n, FP32)["total"]
        text = ("all-gather: the ring's 3 x 2 (N-1) (S/N) kv_hidden x 4 B "
                "(theory.ring_attention_bytes)")
    else:
        per = theory.ring_attention_bytes(tokens, kv, n, FP32)["total"]
        text = "ring attention: 3 x 2 (N-1) (S/N) kv_hidden x 4 B (theory.ring_attention_bytes)"
    return Formula(steps * m * layers * per, f"{counted(steps)} x m x {layers} layers x {text}; "
                   f"S = b x seq = {tokens}, kv_hidden = {kv}, N = {n}, m = {m}")


def ep_formula(gpt, plan: Plan, mesh: Mesh, optimizer, steps: int,
               crossing_rows: int | None) -> Formula | None:
    """Bytes over ``mesh.ep_group`` and the experts' ``mesh.expert_dp_group``; ``None`` without
    the measured ``crossing_rows`` (module docstring)."""
    if crossing_rows is None:
        return None
    cfg, n, m = gpt.cfg, plan.ep, plan.micro_batches
    layers = layers_held(gpt)[0] - layers_held(gpt)[1]
    counts = steps * m * layers * theory.all_to_all_bytes(cfg.num_experts * 8, n)
    rows = 4 * crossing_rows * cfg.hidden * FP32
    experts = [p for blk in gpt.blocks if isinstance(blk, Block) and blk.moe is not None
               for p in blk.moe.experts.parameters()]
    replicas = mesh.dp_cp_size // n
    grads = 0.0
    if replicas > 1:
        inner = getattr(optimizer, "optimizers", (None, None))[1]
        size = sum(bk.padded * bk.flat.element_size() for bk in inner.buckets) if inner \
            else sum(p.numel() * p.element_size() for p in experts)
        zero = 1 if plan.zero == 3 else plan.zero  # ZeRO-3 gives the experts ZeRO-1
        chunks = chunks_per_rank(plan.schedule) if plan.pp > 1 else 1
        grads = steps * gradient_all_reduces(zero, m * chunks) * \
            theory.ring_all_reduce_bytes(size, replicas)
    return Formula(counts + rows + grads,
                   f"{counted(steps)} x m x {layers} layers x counts (N-1)/N x E x 8 B + 4 x "
                   f"{crossing_rows} rows sent to other ranks' experts (router) x h x 4 B"
                   + (f" + the experts' gradients over {replicas} ranks" if grads else ""))


def gradient_all_reduces(zero: int, backwards: int) -> float:
    """A step's data-parallel traffic in all-reduces of the parameter bytes, ZeRO-0 to 2:
    ZeRO-2 reduce-scatters at each of the step's ``backwards`` (the micro-batches, times the
    chunks a pipeline rank holds: each chunk's B, or W, sends its own) and all-gathers once."""
    return {0: 1.0, 1: 1.0, 2: (backwards + 1) / 2}[zero]


def pp_formula(gpt, plan: Plan, mesh: Mesh, b: int, steps: int) -> Formula:
    """Bytes over ``mesh.pp_group`` and ``mesh.embedding_group`` (module docstring)."""
    cfg, p, m = gpt.cfg, plan.pp, plan.micro_batches
    v, placement = chunks_per_rank(plan.schedule), schedule_spec(plan.schedule).placement
    owner = {vs: r for r in range(p) for vs in virtual_stages(r, p, v, placement)}
    me, last = mesh.coords.pp, p * v - 1
    mine = [vs for vs, _, _ in chunk_layout(cfg.layers, mesh, plan.schedule)]
    forward = sum(vs < last and owner[vs + 1] != me for vs in mine)
    backward = sum(vs > 0 and owner[vs - 1] != me for vs in mine)
    s = cfg.seq_len // plan.cp // (plan.tp if plan.sequence_parallel else 1)
    activation = b * s * cfg.hidden * FP32
    total = steps * ((forward + backward) * m * activation + forward * SHAPE_HEADER_BYTES)
    text = (f"{counted(steps)} x ({forward} + {backward}) boundaries x m x bsh x 4 B + "
            f"{forward} x {SHAPE_HEADER_BYTES} B shape header; b = {b}, s = {s}")
    holds_tied = gpt.tok is not None or gpt.head is not None
    if cfg.tied and tied_across_ranks(plan.schedule) and holds_tied:
        weight = (gpt.tok if gpt.tok is not None else gpt.head).weight  # ZeRO-3: its shard
        total += steps * theory.ring_all_reduce_bytes(weight.numel() * FP32, 2)
        text += " + the tied embedding's all-reduce 2(2-1)/2 x (V/t) h x 4 B (ZeRO-3: its shard)"
    if me == loss_stage(plan.schedule, p):
        total += steps * (p - 1) * FP32
        text += f" + the loss broadcast, {p - 1} x 4 B"
    return Formula(total, text)


def dp_formula(par_bytes: int, replicas: int, zero: int, steps: int, micro_batches: int,
               root_bytes: int = 0, tied_bucket_bytes: int = 0, chunks: int = 1,
               index: int | None = None, pipeline: bool = False,
               dtype_scales: tuple[float, float] = (1.0, 1.0)) -> float:
    """Bytes one rank sends over dp x cp in ``steps`` steps (module docstring), for
    ``par_bytes`` of (padded) parameters; ``root_bytes``: ZeRO-3's root group, padded;
    ``tied_bucket_bytes``: ZeRO-2's bucket holding a tied embedding gathered in a pipeline;
    ``chunks``: model chunks per pipeline rank (ZeRO-2 reduce-scatters every bucket of the
    rank at each chunk's backward: ``chunks`` reduce-scatters per micro-batch);
    ``index``: this rank's place in the dp x cp ring, for the loss's exact bytes (a scalar
    does not split evenly: :func:`engine.theory.ring_all_reduce_rank_bytes`; None: the mean);
    ``pipeline``: ZeRO-3's root is gathered and reduce-scattered once a step
    (:meth:`engine.fsdp.step.ShardedStep.gathered`), not once a micro-batch;
    ``dtype_scales``: ZeRO-3's ``(gathered, reduced)`` bytes per byte of ``par_bytes``
    (:func:`zero3_dtype_scales`: ``(0.5, 1)`` for fp32 shards gathered in bf16 and reduced in
    fp32). A group other than the root sends two all-gathers and a reduce-scatter per
    micro-batch, ``(2g + r) A / 2``; the root one of each, per micro-batch or per step."""
    if replicas == 1:
        return 0.0
    if zero == 3:
        g, r = dtype_scales
        root_times = 1 if pipeline else micro_batches  # gathers (and reductions) of the root
        per_step = ring_all_reduce(par_bytes, replicas) / 2 * (2 * g + r) * micro_batches - \
            ring_all_reduce(root_bytes, replicas) / 2 * \
            ((2 * g + r) * micro_batches - (g + r) * root_times)
    else:
        per_step = ring_all_reduce(par_bytes, replicas) * gradient_all_reduces(
            zero, micro_batches * chunks)
    per_step += theory.ring_all_gather_bytes(tied_bucket_bytes, replicas)
    return steps * (per_step + loss_all_reduce(replicas, index))


def zero3_dtype_scales(par) -> tuple[float, float]:
    """ZeRO-3's bytes gathered and reduced per byte of its fp32 shards
    (:class:`engine.fsdp.MixedPrecisionPolicy`: ``param_dtype``, ``reduce_dtype``);
    ``(1, 1)`` without a policy or without ZeRO-3."""
    if par.sharding is None or not par.sharding.groups:
        return 1.0, 1.0
    group = par.sharding.groups[0]
    shard = group.params[0].shard.element_size()
    return (group.gather_dtype.itemsize / shard, group.reduce_dtype.itemsize / shard)


def ring_all_reduce(size: float, n: int) -> float:
    return theory.ring_all_reduce_bytes(size, n)


def loss_all_reduce(n: int, index: int | None = None) -> float:
    """The step's loss (one fp32) all-reduced over ``n`` ranks: the bytes of the rank at
    ``index`` of the ring, or the mean over the ranks (None)."""
    return ring_all_reduce(4, n) if index is None else \
        theory.ring_all_reduce_rank_bytes(1, 4, n, index)


def ring_index(mesh) -> int:
    """This rank's place in the ring over ``mesh.dp_cp_group`` (the group's rank order)."""
    return ops.group_ranks(mesh.dp_cp_group).index(mesh.rank)


def dense_parameter_bytes(par) -> tuple[int, int, int]:
    """``(parameter bytes, ZeRO-3 root bytes, ZeRO-2 tied bucket bytes)`` of what the
    data-parallel wrapper of ``par`` (a :class:`engine.compose.parallelize.Parallel`) reduces
    over dp x cp, padded as the wrapper pads (ZeRO-3: each group's padded chunks,
    :mod:`engine.fsdp.comm`)."""
    from engine.zero import ZeroOptimizer

    optimizer, plan = par.optimizer, par.plan
    gpt = par.model
    tied_here = plan.pp > 1 and gpt.cfg.tied and tied_across_ranks(plan.schedule) and \
        (gpt.tok is not None or gpt.head is not None)
    if par.sharding is not None:
        def padded(group) -> int:
            return group.world_size * sum(p.layout.chunk_numel for p in group.params) * \
                group.params[0].shard.element_size()
        root = par.sharding.root
        return (sum(padded(g) for g in par.sharding.groups),
                padded(root) if root.params else 0, 0)
    dense = getattr(optimizer, "optimizers", (optimizer,))[0]
    if isinstance(dense, ZeroOptimizer):
        size = sum(bk.padded * bk.flat.element_size() for bk in dense.buckets)
        tied = 0
        if plan.zero == 2 and tied_here:
            weight = (gpt.tok if gpt.tok is not None else gpt.head).weight
            tied = dense.launcher.bucket_of[weight].padded * weight.element_size()
        return size, 0, tied
    experts = {id(p) for blk in par.model.blocks if isinstance(blk, Block)
               and blk.moe is not None for p in blk.moe.experts.parameters()} \
        if plan.ep > 1 else set()
    return (sum(p.numel() * p.element_size() for p in par.model.parameters()
                if id(p) not in experts), 0, 0)


def layout_formulas(par, micro_rows: int, steps: int = 1,
                    crossing_rows: int | None = None) -> dict[str, Formula | None]:
    """Per kind of group, the bytes this rank of ``par`` (a :class:`engine.compose.
    parallelize.Parallel`) sends in ``steps`` steps of ``micro_rows`` rows a micro-batch;
    0 for a dimension of one rank, ``None`` where no formula is known (the experts without
    ``crossing_rows``; compressed DDP's compressor unknown to :func:`compressed_dp_formula`)."""
    plan, mesh, gpt = par.plan, par.mesh, par.model
    b, out = micro_rows, {}
    size, root, tied = dense_parameter_bytes(par)
    n = mesh.dp_cp_size
    index = ring_index(mesh) if n > 1 else 0
    if plan.compress is not None and n > 1:
        c = compressed_dp_formula(par.compressing, n)
        out["dp"] = Formula(steps * (c.bytes + loss_all_reduce(n, index))
                            + balance_bytes(gpt, mesh, plan.micro_batches, steps),
                            f"{counted(steps)} x ({c.text} + the loss 2(N-1)/N x 4 B; MoE: + "
                            "the balancing statistics, experts.balance_bytes)")
    else:
        scales = zero3_dtype_scales(par)
        out["dp"] = Formula(dp_formula(size, n, plan.zero, steps, plan.micro_batches, root,
                                       tied, chunks_per_rank(plan.schedule) if plan.pp > 1
                                       else 1, index, plan.pp > 1, scales)
                            + balance_bytes(gpt, mesh, plan.micro_batches, steps),
                            f"{counted(steps)} x ZeRO-{plan.zero} over N = {n}: "
                            f"parameters of {size:,} B" + (
                                f", gathered x {scales[0]:g} and reduced x {scales[1]:g} "
                                "(MixedPrecisionPolicy)" if scales != (1.0, 1.0) else "") +
                            " (+ the loss 2(N-1)/N x 4 B; MoE: + the balancing statistics, "
                            "experts.balance_bytes)")
    out["tp"] = tp_formula(gpt, plan, b, steps) if plan.tp > 1 else Formula(0, "tp = 1")
    out["cp"] = cp_formula(gpt, plan, b, steps) if plan.cp > 1 else Formula(0, "cp = 1")
    out["ep"] = ep_formula(gpt, plan, mesh, par.optimizer, steps, crossing_rows) \
        if plan.ep > 1 else Formula(0, "ep = 1")
    out["pp"] = pp_formula(gpt, plan, mesh, b, steps) if plan.pp > 1 else Formula(0, "pp = 1")
    return out


def compressed_dp_formula(model, n: int) -> Formula:
    """The data-parallel bytes of ``model`` (:class:`engine.dp.DataParallel`, or a stage-0
    :class:`engine.zero.ZeroOptimizer`) with its compressor, one reduction per step (DDP's
    gradients accumulate under ``no_sync``; the optimizer reduces at the step)."""
    from engine.compress.cast import BF16, FP16
    from engine.compress.powersgd import PowerSGD
    from engine.compress.topk import TopK

    c, sizes = model.compressor, [b.padded for b in model.buckets]
    psi = sum(sizes)
    if c is None:
        return Formula(theory.ring_all_reduce_bytes(psi * 4, n),
                       f"2(N-1)/N x Ψ x 4 B (theory.ring_all_reduce_bytes), N = {n}")
    if isinstance(c, (FP16, BF16)):
        return Formula(theory.ring_all_reduce_bytes(psi * 2, n),
                       f"2(N-1)/N x Ψ x 2 B, 16-bit (theory.ring_all_reduce_bytes), N = {n}")
    if isinstance(c, TopK):  # Random-K too: the same k per bucket
        return Formula(sum(theory.topk_bytes_per_rank(size, c.ratio, n) for size in sizes),
                       f"per bucket (N-1) x k x (4 B value + 4 B index), k = ceil({c.ratio} x "
                       f"bucket) (theory.topk_bytes_per_rank), N = {n}")
    if isinstance(c, PowerSGD) and c.iter >= c.start_iter:
        shapes = [p.shape for b in model.buckets for p in b.params]
        _, sent = theory.powersgd_elements(shapes, c.rank, c.min_compression_rate)
        return Formula(theory.ring_all_reduce_bytes(sent * 4, n),
                       f"2(N-1)/N x 4 B x (sum of (n+m)r over compressed matrices + the rest) "
                       f"(theory.powersgd_elements), r = {c.rank}: {sent:,} elements")
    if isinstance(c, PowerSGD):
        return Formula(theory.ring_all_reduce_bytes(psi * 4, n),
                       f"2(N-1)/N x Ψ x 4 B: PowerSGD averages plainly until step "
                       f"{c.start_iter}")
    return Formula(float("nan"), f"no formula for {c!r}")
