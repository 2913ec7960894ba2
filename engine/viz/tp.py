"""Tensor-parallel pictures: how a linear layer's weight is split by columns and by rows."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from engine.viz.style import apply_style

RANK_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")


def _matrix(ax, x, y, w, h, label, splits=0, axis="col", shade=None):
    """A w x h box at (x, y); ``splits`` coloured slices along ``axis``."""
    if splits:
        for r in range(splits):
            if axis == "col":
                box = Rectangle((x + r * w / splits, y), w / splits, h)
            else:
                box = Rectangle((x, y + (splits - 1 - r) * h / splits), w, h / splits)
            box.set(facecolor=RANK_COLORS[r % 4], alpha=0.55, edgecolor="white")
            ax.add_patch(box)
    else:
        ax.add_patch(Rectangle((x, y), w, h, facecolor=shade or "#cccccc", edgecolor="white"))
    ax.text(x + w / 2, y - 0.35, label, ha="center", va="top", fontsize=9)


def split_figure(t: int = 2):
    """Y = X W with W split over ``t`` ranks: by columns (each rank a slice of Y, no
    communication) and by rows (each rank a partial sum of Y, then an all-reduce)."""
    apply_style()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.4))
    for ax in (left, right):
        ax.set_xlim(-0.3, 11)
        ax.set_ylim(-1.3, 3.6)
        ax.axis("off")
    # column-parallel: X (whole) @ W[:, cols] = Y[:, cols]
    _matrix(left, 0, 0.5, 2, 2.5, "X (whole)")
    left.text(2.5, 1.75, "@", fontsize=14, ha="center", va="center")
    _matrix(left, 3, 0.5, 3, 2.5, f"W by columns ({t} ranks)", t, "col")
    left.text(6.5, 1.75, "=", fontsize=14, ha="center", va="center")
    _matrix(left, 7, 0.5, 3, 2.5, "Y: columns per rank", t, "col")
    left.set_title("Column-parallel: no communication; GeLU(Y_r) is local", fontsize=10)
    # row-parallel: X[:, cols] @ W[rows, :] = sum over ranks
    _matrix(right, 0, 0.5, 2, 2.5, "X by columns", t, "col")
    right.text(2.5, 1.75, "@", fontsize=14, ha="center", va="center")
    _matrix(right, 3, 0.5, 3, 2.5, "W by rows", t, "row")
    right.text(6.5, 1.75, "=", fontsize=14, ha="center", va="center")
    _matrix(right, 7, 0.5, 3, 2.5, "Y = sum of partials", shade="#999999")
    right.text(8.5, 1.75, "all-reduce\n(g)", ha="center", va="center", fontsize=9,
               color="white")
    right.set_title("Row-parallel: every rank a partial sum, one all-reduce", fontsize=10)
    fig.tight_layout()
    return fig
