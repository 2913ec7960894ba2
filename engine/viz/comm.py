"""Bytes on the wire per rank: what the meter measured beside what the formula says."""

from __future__ import annotations

import matplotlib.pyplot as plt

from engine import theory
from engine.viz.style import COLORS, apply_style, full_labels


def bytes_per_rank_figure(measured_sent, expected_sent, title: str = "", unit: float = 1e3):
    """Bars of each rank's measured bytes sent, with the formula's value as a marker."""
    apply_style()
    fig, ax = plt.subplots()
    ranks = range(len(measured_sent))
    ax.bar(ranks, [m / unit for m in measured_sent], color=COLORS["measured"], label="measured")
    ax.scatter(ranks, [e / unit for e in expected_sent], color=COLORS["theory"], marker="_",
               s=900, linewidths=3, label="formula", zorder=3)
    ax.set_xticks(list(ranks), [f"rank {r}" for r in ranks])
    ax.set_ylabel("bytes sent (KB)" if unit == 1e3 else f"bytes sent (/{unit:g})")
    ax.set_title(title)
    top = max(list(measured_sent) + list(expected_sent) + [1]) / unit
    ax.set_ylim(0, top * 1.35)  # room for the legend above the bars
    ax.legend(loc="upper right", ncol=2)
    fig.tight_layout()
    return fig


def all_reduce_figure(size_mb: float = 100.0, max_n: int = 16):
    """Per-rank traffic of a ring all-reduce, 2(N-1)/N·S, as N grows: it tends to 2S."""
    apply_style()
    ns = list(range(1, max_n + 1))
    fig, ax = plt.subplots()
    ax.plot(ns, [theory.ring_all_reduce_bytes(size_mb, n) for n in ns], "o-",
            color=COLORS["theory"], label="ring: sent per rank")
    ax.axhline(2 * size_mb, color="gray", ls="--", lw=1, label="2·S (the limit)")
    ax.set_xlabel("ranks N")
    ax.set_ylabel("MB sent per rank")
    ax.set_title(f"Ring all-reduce of {size_mb:g} MB: per-rank traffic barely grows with N")
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def all_reduce_explorer():
    """A slider over the tensor size and the largest N for :func:`all_reduce_figure`."""
    import ipywidgets as widgets

    def show(size_mb, max_n):
        plt.show(all_reduce_figure(size_mb, max_n))

    return full_labels(widgets.interactive(
        show,
        size_mb=widgets.FloatLogSlider(value=100, base=10, min=0, max=4, description="S (MB)"),
        max_n=widgets.IntSlider(value=16, min=2, max=64, description="max N")))
