"""Per-rank timelines: one row per (rank, lane), a bar per event."""

from __future__ import annotations

import matplotlib.pyplot as plt

from engine.observe.trace import TraceEvent
from engine.viz.style import apply_style

LANE_COLORS = {"compute": "#1f77b4", "comm": "#ff7f0e"}


def timeline_figure(events: list[TraceEvent], title: str = ""):
    """Bars for ``events`` (seconds on a shared clock), rows ``rank r: lane``, time from 0 in ms."""
    apply_style()
    if not events:
        raise ValueError("no events to draw")
    t0 = min(e.start for e in events)
    rows = sorted({(e.rank, e.lane) for e in events}, key=lambda r: (r[0], r[1] != "compute"))
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.4))
    for i, (rank, lane) in enumerate(rows):
        y = len(rows) - 1 - i
        for e in (e for e in events if (e.rank, e.lane) == (rank, lane)):
            ax.barh(y, (e.end - e.start) * 1e3, left=(e.start - t0) * 1e3, height=0.6,
                    color=LANE_COLORS.get(lane, "#7f7f7f"), edgecolor="white", linewidth=0.5)
            wide = (e.end - e.start) * 1e3 > 0.08 * max((x.end - t0) * 1e3 for x in events)
            if wide and lane != "comm":  # async comm ops overlap each other: no labels there
                ax.text((e.start - t0 + (e.end - e.start) / 2) * 1e3, y, e.name, ha="center",
                        va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(rows)), [f"rank {r}: {lane}" for r, lane in reversed(rows)])
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    ax.grid(axis="y", visible=False)
    fig.tight_layout()
    return fig
