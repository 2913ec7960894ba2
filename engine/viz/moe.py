"""Mixture-of-experts pictures: each expert's load against its capacity (what is dropped), the
rows an all-to-all moves between ranks, and the load per rank over training steps."""

from __future__ import annotations

import matplotlib.pyplot as plt

from engine.labs.moe import zipf_logits
from engine.moe.router import route
from engine.viz.style import COLORS, apply_style, full_labels


def load_figure(capacity_factor: float = 1.25, skew: float = 1.0, num_experts: int = 8,
                top_k: int = 2, tokens: int = 512, seed: int = 0):
    """Assignments per expert for ``tokens`` tokens of a power-law router of ``skew``
    (:func:`engine.labs.moe.zipf_logits`): the part within capacity and the part
    dropped, with the capacity line."""
    apply_style()
    r = route(zipf_logits(tokens, num_experts, skew, seed), top_k, capacity_factor)
    kept, demand = r.load.tolist(), r.demand.tolist()
    dropped = [d - k for d, k in zip(demand, kept)]
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    experts = range(num_experts)
    ax.bar(experts, kept, color=COLORS["measured"], label="processed")
    ax.bar(experts, dropped, bottom=kept, color=COLORS["idle"], alpha=0.6, hatch="//",
           label="dropped (over capacity)")
    ax.axhline(r.capacity, color="black", linestyle="--", linewidth=1)
    ax.text(num_experts - 0.5, r.capacity, f" capacity {r.capacity}", va="bottom", ha="right",
            fontsize=9)
    ax.axhline(tokens * top_k / num_experts, color="gray", linestyle=":", linewidth=1,
               label="balanced load T k / E")
    ax.set_xticks(list(experts))
    ax.set_xlabel("expert")
    ax.set_ylabel("assignments")
    ax.set_title(f"{tokens} tokens, top-{top_k}, capacity factor {capacity_factor:g}, skew "
                 f"{skew:g}: {r.dropped} of {r.keep.numel()} dropped ({r.drop_rate:.1%})")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def capacity_explorer():
    """Widgets over :func:`load_figure`: capacity factor, router skew, experts, top-k."""
    import ipywidgets as widgets

    def show(capacity_factor, skew, num_experts, top_k):
        plt.show(load_figure(capacity_factor, skew, num_experts, top_k))

    return full_labels(widgets.interactive(
        show,
        capacity_factor=widgets.FloatSlider(value=1.25, min=0.25, max=3.0, step=0.05,
                                            description="capacity factor"),
        skew=widgets.FloatSlider(value=1.0, min=0.0, max=3.0, step=0.1,
                                 description="router skew"),
        num_experts=widgets.SelectionSlider(options=[2, 4, 8, 16, 32, 64], value=8,
                                            description="experts"),
        top_k=widgets.IntSlider(value=2, min=1, max=4, description="top-k"),
    ))


def all_to_all_figure(rows, title: str = "dispatch: rows from rank i to rank j"):
    """``rows[i][j]``: the rows rank i sent to rank j in one all-to-all (the diagonal never
    leaves its rank)."""
    apply_style()
    n = len(rows)
    fig, ax = plt.subplots(figsize=(3.2 + 0.5 * n, 2.8 + 0.4 * n))
    image = ax.imshow(rows, cmap="Blues")
    for i in range(n):
        for j in range(n):
            ax.text(j, i, f"{rows[i][j]}" + ("\n(local)" if i == j else ""), ha="center",
                    va="center", fontsize=8,
                    color="white" if rows[i][j] > 0.6 * max(map(max, rows)) else "black")
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xlabel("to rank")
    ax.set_ylabel("from rank")
    ax.grid(False)
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, shrink=0.8)
    fig.tight_layout()
    return fig


def rank_load_figure(runs: dict[str, list[list[int]]], capacity: int | None = None):
    """``runs``: ``{label: [rows each rank processed, per step]}``: min, mean and max over the
    ranks, step by step."""
    apply_style()
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    for color, (label, steps) in zip(("C3", "C0", "C2", "C1"), runs.items()):
        xs = range(len(steps))
        ax.plot(xs, [sum(s) / len(s) for s in steps], color=color, label=f"{label}: mean")
        ax.fill_between(xs, [min(s) for s in steps], [max(s) for s in steps], color=color,
                        alpha=0.2, label=f"{label}: min to max")
    if capacity is not None:
        ax.axhline(capacity, color="black", linestyle="--", linewidth=1,
                   label="most a rank can take")
    ax.set_xlabel("training step")
    ax.set_ylabel("rows processed per rank")
    ax.set_title("Per-rank expert load over training")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def max_violation_figure(runs: dict[str, list[float]], smooth: int = 5):
    """``runs``: ``{label: MaxVio per step}`` (:func:`engine.theory.max_violation`): each run's
    MaxVio over training, a running mean of ``smooth`` steps drawn over the raw values."""
    apply_style()
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    for color, (label, values) in zip(("C3", "C0", "C2", "C1"), runs.items()):
        mean = [sum(values[max(0, i - smooth + 1):i + 1]) / len(values[max(0, i - smooth + 1):
                                                                        i + 1])
                for i in range(len(values))]
        ax.plot(values, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(mean, color=color, label=f"{label}: last step {values[-1]:.2f}")
    ax.axhline(0, color="black", linewidth=0.8)
    top = max(max(values) for values in runs.values())
    ax.set_ylim(-0.05 * top, 1.4 * top)  # room for the legend above the curves
    ax.set_xlabel("training step")
    ax.set_ylabel("MaxVio = max load / mean load - 1")
    ax.set_title("Expert load imbalance over training, from the same skewed start")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig
