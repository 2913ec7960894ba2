"""The memory table of chapter 06: what each pipeline rank holds for backward under 1F1B,
ZB-H1, ZB-H2, ZB-V and DualPipeV, measured on a model made of transformer blocks, beside each
schedule's formula (its registry record's ``peak``, :func:`engine.theory.
pipeline_peak_activations`), and the point-to-point messages each sends
(:func:`engine.theory.pipeline_p2p_hops`).

A stack of MLP blocks is a misleading test bed for a split backward: nearly every activation
there is some linear layer's input, so the W-stash (each linear layer's input and output
gradient, kept from B to W; :mod:`engine.pp.weight_grad`) outweighs what B frees. A
transformer block also keeps what its W does not need (the attention probabilities, the
normalised inputs, the GELU's input), so the stash is smaller than the activations, the case
the zero-bubble paper's memory claims assume (Qi et al. 2024, Table 1: ``32sbh`` for W
against ``34sbh + 5as^2b`` for B, per layer in fp16).

:func:`memory_rank` runs one step of each schedule on this rank (one launch for all of
them); :func:`memory_rows` turns the ranks' results into one row per schedule, in units of
``M_B``: one micro-batch's activations on the rank's whole share of the model.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.gpt import Block, GPTConfig
from engine.model.seed import seeded
from engine.pp.actions import virtual_stages
from engine.pp.partition import split_model, uniform_boundaries
from engine.pp.registry import build_schedule, schedule_spec
from engine.pp.runtime import run_pipeline

NAMES = ("1f1b", "zb_h1", "zb_h2", "zb_v", "dualpipe_v")


def transformer_layers(blocks: int, cfg: GPTConfig = GPTConfig(hidden=64, heads=4, seq_len=32),
                       seed: int = 0) -> nn.Sequential:
    """``blocks`` transformer blocks of :class:`engine.model.gpt.Block` (attention and MLP, each
    behind a LayerNorm and a residual), taking and giving ``(batch, seq, hidden)``."""
    with seeded(seed):
        return nn.Sequential(*[Block(cfg) for _ in range(blocks)])


def sent_messages(run) -> int:
    """Tensors this rank sent to another rank in ``run`` (its p2p log's data sends; a hand-over
    to itself, the bottom of a V, is not a message)."""
    return sum(1 for kind, items in run.p2p_log if kind == "post"
               for op, _, _, part in items if op == "send" and part == "data")


def memory_rank(rank: int, p: int, m: int, names=NAMES, blocks_per_stage: int = 2,
                rows: int = 2, cfg: GPTConfig = GPTConfig(hidden=64, heads=4, seq_len=32)):
    """One step of each schedule in ``names`` on ``p`` ranks, ``m`` micro-batches of ``rows``
    sequences, on ``blocks_per_stage * p`` transformer blocks (cut into one piece per virtual
    stage); this rank's counts per schedule: peak bytes held for backward, one micro-batch's
    activations and W-stash (summed over the rank's chunks), micro-batch chunks held at the
    peak, and the tensors sent to other ranks."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(rows, cfg.seq_len, cfg.hidden, generator=g) for _ in range(m)]
    ys = [torch.randn(rows, cfg.seq_len, cfg.hidden, generator=g) for _ in range(m)]
    out = {}
    for name in names:
        schedule = build_schedule(name, p, m)
        v = schedule.v
        layers = transformer_layers(blocks_per_stage * p, cfg)
        pieces = split_model(layers, uniform_boundaries(len(layers), p * v))
        mine = [pieces[i] for i in virtual_stages(rank, p, v, schedule.placement)]
        torch.distributed.barrier()
        run = run_pipeline(mine, schedule, xs, ys, stage=rank)
        out[name] = {"peak_bytes": run.peak_activation_bytes,
                     "activation_bytes": sum(run.activation_bytes.values()),
                     "stash_bytes": sum(run.weight_stash_bytes.values()),
                     "peak_in_flight": run.peak_in_flight / v, "peak_held": run.peak_held / v,
                     "sent": sent_messages(run), "chunks": v}
    return out


def memory_rows(results: list[dict], m: int) -> list[dict]:
    """One row per schedule from every rank's :func:`memory_rank`: the formula for the busiest
    rank and its source, each rank's measured peak in ``M_B`` (the rank's peak bytes over its
    own one-micro-batch activations; it includes the W-stash of a split backward), the
    micro-batches held (F to B, and F to W), the W-stash over the activations of one
    micro-batch, and the messages per micro-batch, measured (all ranks' sends over ``m``) and
    by formula."""
    from engine import theory

    p = len(results)
    rows = []
    for name in results[0]:
        per_rank, peak = [r[name] for r in results], schedule_spec(name).peak
        rows.append({
            "schedule": name, "formula": theory.pipeline_peak_activations(name, p),
            "formula_text": peak.formula, "source": peak.source,
            "measured": [r["peak_bytes"] / r["activation_bytes"] for r in per_rank],
            "in_flight": [r["peak_in_flight"] for r in per_rank],
            "held": [r["peak_held"] for r in per_rank],
            "stash_over_activations": [r["stash_bytes"] / r["activation_bytes"]
                                       for r in per_rank],
            "hops": sum(r["sent"] for r in per_rank) / m,
            "hops_formula": theory.pipeline_p2p_hops(name, p)})
    return rows
