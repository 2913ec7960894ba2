"""The parity matrix as a figure: one row per layout of :mod:`engine.compose.parity`.

Left, how far each layout ended from one process after its steps: the largest loss difference
and the largest parameter difference on a log scale, with the 1e-6 tolerance drawn (an exact
zero is drawn at the axis' floor and labelled 0). Right, the bytes each kind of group sent,
counted on the wire and summed over the ranks, stacked per layout, with the formula's total
marked where every kind has one.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

KIND_COLORS = {"dp": "#1f77b4", "cp": "#ff7f0e", "ep": "#9467bd", "tp": "#2ca02c",
               "pp": "#d62728"}
FLOOR = 1e-10  # where an exact 0 is drawn on the log axis


def parity_figure(results, tolerance: float = 1e-6):
    """``results``: :class:`engine.compose.parity.Result` objects (``row.name``,
    ``loss_diff``, ``param_diff``, ``sent`` and ``formulas`` per kind). Returns the figure."""
    names = [r.row.name for r in results]
    y = list(range(len(results)))[::-1]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.45 * len(results) + 2.0),
                                      sharey=True, gridspec_kw={"width_ratios": [1, 1.3]})
    for offset, key, label, marker in ((0.15, "loss_diff", "max |Δloss|", "o"),
                                       (-0.15, "param_diff", "max |Δparam|", "s")):
        values = [max(getattr(r, key), FLOOR) for r in results]
        left.scatter(values, [v + offset for v in y], marker=marker, label=label, zorder=3)
        for value, row in zip(values, y):
            if value == FLOOR:
                left.annotate("0", (value, row + offset), xytext=(5, -4),
                              textcoords="offset points", fontsize=8)
    left.axvline(tolerance, color="black", linestyle="--", label=f"tolerance {tolerance:g}")
    left.set_xscale("log")
    left.set_xlim(FLOOR / 3, tolerance * 30)
    left.set_yticks(y, names)
    left.set_xlabel("difference from one process (fp32, after 3 AdamW steps)")
    left.legend(loc="lower left", bbox_to_anchor=(0, 1.01), ncol=3, fontsize=8, frameon=False)
    left.grid(axis="x", alpha=0.3)
    start = [0.0] * len(results)
    for kind, color in KIND_COLORS.items():
        widths = [r.sent.get(kind, 0) / 1e6 for r in results]
        right.barh(y, widths, left=start, color=color, label=kind, height=0.6)
        start = [a + b for a, b in zip(start, widths)]
    for r, row in zip(results, y):
        formulas = [r.formulas.get(kind) for kind in KIND_COLORS]
        if formulas and None not in formulas:
            right.plot(sum(formulas) / 1e6, row, marker="|", color="black", markersize=14)
    right.plot([], [], marker="|", color="black", linestyle="none", markersize=10,
               label="formula")
    right.set_xlabel("MB sent on the wire, summed over the ranks")
    right.set_xlim(0, 1.08 * max(start + [1e-6]))
    right.legend(loc="lower left", bbox_to_anchor=(0, 1.01), ncol=6, fontsize=8, frameon=False)
    right.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig
