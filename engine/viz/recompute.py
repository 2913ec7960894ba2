"""Activation checkpointing's trade, drawn: the bytes kept for backward against the FLOPs paid,
measured on the tiny GPT (:mod:`engine.precision.recompute`), beside Korthikanti et al.'s
per-layer formulas (:mod:`engine.theory`)."""

from __future__ import annotations

import matplotlib.pyplot as plt

from engine import theory
from engine.model.gpt import GPTConfig
from engine.precision.recompute import PLANS, pareto
from engine.viz.style import COLORS, apply_style

POLICY_COLORS = {"none": "#1f77b4", "selective": "#2ca02c", "full": "#d62728"}


def plot_recompute_pareto(cfg: GPTConfig = GPTConfig(vocab=64, seq_len=64, layers=4, heads=4,
                                                      hidden=32), batch: int = 2,
                          budgets: int = 12, points=None):
    """Left: every plan measured (the uniform policies and the budget plans, ``s`` selective,
    ``f`` full, ``n`` none per block), bytes saved for backward against forward + backward
    FLOPs. Right: one layer's bytes, measured, beside the paper's formulas for the same
    ``s, b, h, a``. Returns ``(figure, points)``."""
    apply_style()
    points = pareto(cfg, batch, budgets) if points is None else points
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=(3, 2))
    front = sorted(points, key=lambda r: r.saved_bytes)
    left.plot([r.saved_bytes / 2**10 for r in front], [r.flops / 1e6 for r in front],
              color="0.7", zorder=1)
    for r in front:
        color = POLICY_COLORS.get(r.label, COLORS["theory"])
        left.scatter(r.saved_bytes / 2**10, r.flops / 1e6, color=color, zorder=2,
                     s=60 if r.label in PLANS else 30)
        left.annotate(r.label, (r.saved_bytes / 2**10, r.flops / 1e6), fontsize=8,
                      xytext=(4, 4), textcoords="offset points")
    left.text(0.98, 0.95, "big: one policy for every block\nsmall: a memory-budget plan",
              transform=left.transAxes, ha="right", va="top", fontsize=8)
    left.set_xlabel("bytes saved for backward (KiB, counted by saved-tensor hooks)")
    left.set_ylabel("forward + backward MFLOP (FlopCounterMode)")
    left.set_title(f"tiny GPT, {cfg.layers} blocks, s={cfg.seq_len}, h={cfg.hidden}, "
                   f"a={cfg.heads}, b={batch}")
    s, b, h, a = cfg.seq_len, batch, cfg.hidden, cfg.heads
    measured = {r.label: r.saved["block 0"] for r in points if r.label in PLANS}
    paper = {p: theory.recompute_activation_bytes_per_layer(s, b, h, a, p) for p in PLANS}
    xs = range(len(PLANS))
    right.bar([x - 0.2 for x in xs], [measured[p] / 2**10 for p in PLANS], width=0.4,
              color=COLORS["measured"], label="measured (fp32, no dropout)")
    right.bar([x + 0.2 for x in xs], [paper[p] / 2**10 for p in PLANS], width=0.4,
              color=COLORS["theory"], label="Korthikanti et al. (fp16, dropout)")
    right.set_xticks(list(xs), PLANS)
    right.set_ylabel("KiB per layer")
    right.set_title("one layer: 34sbh+5as²b, 34sbh, 2sbh")
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig, points
