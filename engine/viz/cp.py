"""Long-context pictures: ring attention step by step, and memory and bytes as the sequence grows.

:func:`ring_step_figure` draws the ``S x S`` attention matrix cut into chunk blocks: which rank
computes each block, which blocks the ring computes at a given step, which are skipped because
the causal mask hides them entirely, and the load each rank has carried so far.
:func:`ring_explorer` is the same with sliders. :func:`long_context_figure` compares, per GPU
and per layer, activation memory and bytes sent by tensor parallelism, sequence parallelism,
ring attention and Ulysses, from :mod:`engine.theory`.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

from engine import theory
from engine.cp.layout import rank_chunks
from engine.cp.ring import ring_schedule
from engine.viz.style import apply_style, full_labels

RANK_COLORS = plt.get_cmap("tab10").colors


def ring_step_figure(n: int = 4, layout: str = "zigzag", step: int = 0, causal: bool = True):
    """Left: the attention matrix in chunks (rows: query chunks, columns: key chunks). A block
    is coloured by the rank that computes it, solid if computed at ``step``, faint if at
    another step; a hatched block is fully masked and never computed. Right: blocks computed
    per rank up to and including ``step`` (a diagonal block counts as a whole block)."""
    apply_style()
    schedule = ring_schedule(n, layout, causal)
    chunks = 2 * n if layout == "zigzag" else n
    fig, (grid, load) = plt.subplots(1, 2, figsize=(10.5, 4.4),
                                     gridspec_kw={"width_ratios": [1.15, 1]})
    done = np.zeros(n)
    for rank, steps in schedule.items():
        mine = rank_chunks(rank, n, layout)
        for s, pairs in enumerate(steps):
            theirs = rank_chunks((rank - s) % n, n, layout)
            for a, b, kind in pairs:
                row, col = mine[a], theirs[b]
                alpha = 0.95 if s == step else 0.18
                grid.add_patch(Rectangle((col, chunks - 1 - row), 1, 1, alpha=alpha,
                                         facecolor=RANK_COLORS[rank % 10], edgecolor="white"))
                if kind == "diagonal":
                    grid.plot([col, col + 1], [chunks - row, chunks - 1 - row], color="white",
                              lw=1)
                if s <= step:
                    done[rank] += 1
    for row in range(chunks):
        for col in range(chunks):
            if causal and col > row:
                grid.add_patch(Rectangle((col, chunks - 1 - row), 1, 1, fill=False,
                                         hatch="///", edgecolor="#bbbbbb", lw=0))
    grid.set_xlim(0, chunks)
    grid.set_ylim(0, chunks)
    grid.set_aspect("equal")
    grid.set_xticks(np.arange(chunks) + 0.5, range(chunks))
    grid.set_yticks(np.arange(chunks) + 0.5, reversed(range(chunks)))
    grid.grid(False)
    grid.set_xlabel("key chunk")
    grid.set_ylabel("query chunk")
    grid.set_title(f"{layout}, N = {n}: step {step} (solid), other steps faint,\n"
                   "hatched = masked, never computed", fontsize=10)
    load.bar(range(n), done, color=[RANK_COLORS[r % 10] for r in range(n)])
    totals = [sum(len(p) for p in steps) for steps in schedule.values()]
    load.plot(range(n), totals, "k_", markersize=22, label="whole forward")
    load.set_xticks(range(n), [f"rank {r}" for r in range(n)])
    load.set_ylabel("blocks computed")
    load.set_title(f"load after step {step} (busiest / mean at the end: "
                   f"{max(totals) / (sum(totals) / n):.2f})", fontsize=10)
    load.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def ring_explorer():
    """Sliders: ranks N, layout, ring step, causal mask; draws :func:`ring_step_figure`."""
    import ipywidgets as widgets

    n = widgets.IntSlider(value=4, min=1, max=8, description="ranks N")
    step = widgets.IntSlider(value=0, min=0, max=3, description="ring step")
    n.observe(lambda change: setattr(step, "max", change["new"] - 1), names="value")

    def show(n, layout, step, causal):
        plt.show(ring_step_figure(n, layout, min(step, n - 1), causal))

    return full_labels(widgets.interactive(
        show, n=n, layout=widgets.ToggleButtons(options=["zigzag", "contiguous"],
                                                description="layout"),
        step=step, causal=widgets.Checkbox(value=True, description="causal mask")))


def long_context_rows(seq_lens, hidden: int = 4096, heads: int = 32, kv_heads: int = 8,
                      n: int = 8, dtype_bytes: int = 2, layers: int = 1
                      ) -> dict[str, dict[str, list[float]]]:
    """Per GPU, for ``layers`` layers and one sequence of each length: activation bytes stored
    (Korthikanti et al. 2023 without the ``5as/h`` score term: every method here uses an
    attention that keeps no ``s x s`` scores) and bytes sent forward + backward."""
    kv_hidden = hidden * kv_heads // heads
    rows = {"memory": {}, "bytes": {}}
    for name in ("one GPU", f"TP {n}", f"TP+SP {n}", f"ring CP {n}", f"Ulysses {n}"):
        rows["memory"][name], rows["bytes"][name] = [], []
    for s in seq_lens:
        sbh = s * hidden
        memory = {"one GPU": 34 * sbh, f"TP {n}": sbh * (10 + 24 / n),
                  f"TP+SP {n}": 34 * sbh / n, f"ring CP {n}": 34 * sbh / n,
                  f"Ulysses {n}": 34 * sbh / n}
        sent = {"one GPU": 0.0,
                f"TP {n}": theory.tp_comm_elements_per_layer(1, s, hidden, n) * dtype_bytes,
                f"TP+SP {n}": theory.sp_comm_elements_per_layer(1, s, hidden, n) * dtype_bytes,
                f"ring CP {n}": theory.ring_attention_bytes(s, kv_hidden, n, dtype_bytes)[
                    "total"],
                f"Ulysses {n}": theory.ulysses_bytes(s, hidden, n, dtype_bytes, kv_hidden)[
                    "total"]}
        for name in memory:
            rows["memory"][name].append(layers * memory[name])
            rows["bytes"][name].append(layers * sent[name])
    return rows


def long_context_figure(seq_lens=(4096, 16384, 65536, 262144, 1048576), hidden: int = 4096,
                        heads: int = 32, kv_heads: int = 8, n: int = 8, dtype_bytes: int = 2,
                        layers: int = 32, memory_gb: float | None = 80):
    """Left: activation GB per GPU for the whole model; right: GB each GPU sends per step
    (forward and backward), one sequence, as the sequence grows. SP, ring CP and Ulysses store
    the same ``34 sbh / N``; they differ in what they send and in what they require."""
    apply_style()
    rows = long_context_rows(seq_lens, hidden, heads, kv_heads, n, dtype_bytes, layers)
    fig, (mem, sent) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"one GPU": "k-", f"TP {n}": "C0-", f"TP+SP {n}": "C1-o",
              f"ring CP {n}": "C2--s", f"Ulysses {n}": "C3:^"}
    for name, style in styles.items():
        mem.plot(seq_lens, np.array(rows["memory"][name]) / 1e9, style, label=name)
        if name != "one GPU":
            sent.plot(seq_lens, np.array(rows["bytes"][name]) / 1e9, style, label=name)
    if memory_gb:
        mem.axhline(memory_gb, color="gray", ls=":", label=f"{memory_gb:.0f} GB GPU")
    for ax in (mem, sent):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length s (tokens)")
        ax.legend(fontsize=8)
    mem.set_ylabel("activation GB per GPU")
    sent.set_ylabel("GB sent per GPU per step (fwd + bwd)")
    mem.set_title(f"{layers} layers, h = {hidden}: memory (TP+SP, CP, Ulysses coincide)",
                  fontsize=10)
    sent.set_title(f"{heads} heads, {kv_heads} KV heads, {8 * dtype_bytes}-bit: traffic",
                   fontsize=10)
    fig.tight_layout()
    return fig
