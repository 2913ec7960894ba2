"""The ring all-reduce, step by step: which ranks' data each chunk holds.

:func:`ring_states` replays the exact chunk schedule of :mod:`engine.comm.ring` (rank r sends
chunk (r-s-1) mod N in reduce-scatter step s, chunk (r-s) mod N in all-gather step s) on sets
of origin ranks instead of numbers, so the picture is the algorithm the engine runs.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from engine.viz.style import apply_style, full_labels


def ring_states(n: int) -> list[list[list[frozenset]]]:
    """``states[step][rank][chunk]``: the origin ranks summed into that chunk; 2(N-1)+1 states."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    state = [[frozenset({r}) for _ in range(n)] for r in range(n)]
    states = [state]
    for step in range(2 * (n - 1)):
        new = [row[:] for row in state]
        for r in range(n):
            right = (r + 1) % n
            if step < n - 1:  # reduce-scatter: add the incoming chunk
                c = (r - step - 1) % n
                new[right][c] = state[right][c] | state[r][c]
            else:  # all-gather: copy the finished chunk
                c = (r - (step - (n - 1))) % n
                new[right][c] = state[r][c]
        state = new
        states.append(state)
    return states


def sent_chunk(n: int, step: int, rank: int) -> int | None:
    """The chunk ``rank`` sends in ``step`` (0-based), or None after the last step."""
    if step >= 2 * (n - 1):
        return None
    return (rank - step - 1) % n if step < n - 1 else (rank - (step - (n - 1))) % n


def ring_step_figure(n: int = 4, step: int = 0):
    """Ranks as rows, chunks as columns; each cell striped with the colours of its origins.

    ``step`` counts completed steps (0 = before the first). The outlined cells are the chunks
    each rank sends in the next step.
    """
    apply_style()
    states = ring_states(n)
    step = max(0, min(step, len(states) - 1))
    colors = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(1.1 * n + 2.6, 0.75 * n + 1.4))
    for r in range(n):
        for c in range(n):
            origins = sorted(states[step][r][c])
            w = 0.94 / len(origins)  # a gap between chunks
            for i, o in enumerate(origins):
                ax.add_patch(Rectangle((c + 0.03 + i * w, n - 1 - r), w, 0.9,
                                       color=colors[o % 10]))
            if len(origins) == n:
                ax.text(c + 0.5, n - 0.55 - r, "Σ", ha="center", va="center", fontsize=14,
                        color="white", weight="bold")
        nxt = sent_chunk(n, step, r)
        if nxt is not None:
            ax.add_patch(Rectangle((nxt, n - 1 - r), 1, 0.9, fill=False, lw=2.5,
                                   edgecolor="black"))
    ax.set_xlim(0, n)
    ax.set_ylim(0, n)
    ax.set_xticks([c + 0.5 for c in range(n)], [f"chunk {c}" for c in range(n)])
    ax.set_yticks([n - 0.55 - r for r in range(n)], [f"rank {r}" for r in range(n)])
    for r, label in enumerate(ax.get_yticklabels()):  # each rank's label in its data's colour
        label.set_color(colors[r % 10])
        label.set_fontweight("bold")
    ax.grid(False)
    phase = ("start" if step == 0 else
             f"reduce-scatter step {step} of {n - 1}" if step <= n - 1 else
             f"all-gather step {step - (n - 1)} of {n - 1}")
    ax.set_title(f"Ring all-reduce, N={n}: {phase}\n(colours: whose data is summed in; "
                 "outlined: sent to the right next)", fontsize=10)
    fig.tight_layout()
    return fig


def ring_stepper():
    """Sliders for N and the step over :func:`ring_step_figure`."""
    import ipywidgets as widgets

    n = widgets.IntSlider(value=4, min=2, max=8, description="ranks N")
    step = widgets.IntSlider(value=0, min=0, max=6, description="step")

    def _limit(change):
        step.max = 2 * (change["new"] - 1)

    n.observe(_limit, names="value")
    return full_labels(widgets.interactive(
        lambda n, step: plt.show(ring_step_figure(n, step)), n=n, step=step))
