"""Pictures of what each collective does, and of where a parameter server's traffic goes."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from engine import theory
from engine.viz.style import COLORS, apply_style

# For each collective on 4 ranks with 4 chunks: (before, after) as [rank][chunk] labels.
# "a".."d" are ranks 0..3's data; "Σ" is the sum over ranks; "" is nothing (or don't-care).
_N = 4
_OWN = [[f"{'abcd'[r]}{c}" for c in range(_N)] for r in range(_N)]
_SUM = [[f"Σ{c}" for c in range(_N)] for _ in range(_N)]
SEMANTICS = {
    "broadcast (root 0)": (_OWN[:1] + [[""] * _N] * 3, [_OWN[0]] * _N),
    "reduce (root 0)": (_OWN, [_SUM[0]] + [[""] * _N] * 3),
    "all-reduce": (_OWN, _SUM),
    "reduce-scatter": (_OWN, [[f"Σ{c}" if c == r else "" for c in range(_N)] for r in range(_N)]),
    "all-gather": ([[_OWN[r][c] if c == r else "" for c in range(_N)] for r in range(_N)],
                   [[_OWN[c][c] for c in range(_N)] for _ in range(_N)]),
}


def _grid(ax, cells, x0):
    colors = plt.get_cmap("tab10").colors
    for r, row in enumerate(cells):
        for c, label in enumerate(row):
            face = ("#444444" if label.startswith("Σ") else
                    colors["abcd".index(label[0])] if label else "#f0f0f0")
            ax.add_patch(Rectangle((x0 + c, _N - 1 - r), 0.92, 0.88, color=face))
            ax.text(x0 + c + 0.46, _N - 0.56 - r, label, ha="center", va="center",
                    color="white" if label else "gray", fontsize=8)


def collectives_figure():
    """Before and after of the five collectives, 4 ranks (rows) by 4 chunks (columns)."""
    apply_style()
    fig, grid = plt.subplots(2, 3, figsize=(11, 5.4))
    axes = grid.flatten()
    axes[-1].axis("off")
    for ax, (name, (before, after)) in zip(axes, SEMANTICS.items(), strict=False):
        _grid(ax, before, 0)
        _grid(ax, after, _N + 1.2)
        ax.annotate("", xy=(_N + 1.1, _N / 2), xytext=(_N + 0.05, _N / 2),
                    arrowprops=dict(arrowstyle="->", lw=1.5))
        ax.set_xlim(-0.1, 2 * _N + 1.3)
        ax.set_ylim(-0.1, _N)
        ax.set_title(name)
        ax.axis("off")
    axes[-1].text(0.05, 0.5, "rows: ranks 0-3\ncolumns: chunks 0-3 of the tensor\n"
                  "a, b, c, d: ranks 0-3's data\nΣ: the sum over all ranks", va="center",
                  fontsize=10)
    fig.tight_layout()
    return fig


def ps_vs_ring_figure(n: int = 8, size_mb: float = 100.0):
    """MB sent per rank: a parameter server (rank 0 serves) against a ring, from theory."""
    apply_style()
    ps = theory.ps_all_reduce_bytes(size_mb, n)
    ring = theory.ring_all_reduce_bytes(size_mb, n)
    ranks = list(range(n))
    width = 0.4
    fig, ax = plt.subplots()
    ax.bar([r - width / 2 for r in ranks], [ps["server_sent"]] + [ps["worker_sent"]] * (n - 1),
           width, color=COLORS["idle"], label="parameter server (rank 0 serves)")
    ax.bar([r + width / 2 for r in ranks], [ring] * n, width, color=COLORS["measured"],
           label="ring")
    ax.set_xticks(ranks, [f"{r}" for r in ranks])
    ax.set_xlabel("rank")
    ax.set_ylabel("MB sent per all-reduce")
    ax.set_title(f"All-reduce of {size_mb:g} MB on {n} ranks: the server's link is the bottleneck")
    ax.legend()
    fig.tight_layout()
    return fig
