"""One figure style for the whole course."""

from __future__ import annotations

import matplotlib as mpl

COLORS = {"measured": "#1f77b4", "theory": "#ff7f0e", "idle": "#d62728", "ok": "#2ca02c"}


def apply_style() -> None:
    mpl.rcParams.update({
        "figure.figsize": (7, 3.6), "figure.dpi": 100, "axes.grid": True, "grid.alpha": 0.3,
        "axes.spines.top": False, "axes.spines.right": False, "font.size": 10,
        "axes.titlesize": 11, "legend.frameon": False,
    })


def full_labels(box):
    """Let every control of an ``ipywidgets.interactive`` box show its whole description
    (the default width cuts "micro-batches m" to "micro-bat..."); returns the box."""
    for child in box.children:
        if getattr(child, "description", "") and hasattr(child, "style") \
                and hasattr(child.style, "description_width"):
            child.style.description_width = "initial"
    return box
