"""ZeRO pictures: model states and activations per GPU, by stage, against device memory; and
the bytes a real run measured next to the formula."""

from __future__ import annotations

import matplotlib.pyplot as plt

from engine import theory
from engine.viz.style import apply_style, full_labels

# name: (parameters, layers, hidden, heads, sequence length), from each model's paper
PRESETS = {
    "GPT-2 1.5B": (1.5e9, 48, 1600, 25, 1024),
    "LLaMA 7B": (6.7e9, 32, 4096, 32, 2048),
    "LLaMA 13B": (13.0e9, 40, 5120, 40, 2048),
    "LLaMA 65B": (65.2e9, 80, 8192, 64, 2048),
    "GPT-3 175B": (175e9, 96, 12288, 96, 2048),
}
DEVICES_GB = {"A100 40GB": 40, "A100 / H100 80GB": 80, "H200 141GB": 141}
PARTS = ("params", "grads", "optimizer", "activations")
PART_COLORS = {"params": "#1f77b4", "grads": "#ff7f0e", "optimizer": "#2ca02c",
               "activations": "#9467bd"}


def per_gpu_bytes(preset: str, gpus: int, stage: int, precision: str = "mixed",
                  offload: bool = False, checkpoint: bool = False, micro_batch: int = 1,
                  psi: float | None = None, seq_len: int | None = None, cp: int = 1
                  ) -> dict[str, float]:
    """Bytes per GPU by part. ``psi`` overrides the preset's parameter count, ``seq_len`` its
    sequence length. ``offload`` moves the optimizer state (with the fp32 master weights) to
    CPU memory. ``cp``: context parallelism over ``cp`` of the GPUs, each holding ``s/cp``
    tokens of every activation (:func:`engine.theory.activation_bytes_per_layer`)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {list(PRESETS)}")
    base_psi, layers, hidden, heads, seq = PRESETS[preset]
    seq = seq if seq_len is None else seq_len
    psi = base_psi if psi is None else psi
    sizes = {} if precision == "mixed" else dict(param_bytes=4, grad_bytes=4, k=8)
    parts = theory.zero_model_state_bytes(psi, gpus, stage, **sizes)
    if offload:
        parts["optimizer"] = 0.0
    acts = layers * theory.activation_bytes_per_layer(seq, micro_batch, hidden, heads, cp=cp,
                                                      recompute=checkpoint)
    if precision != "mixed":
        acts *= 2  # fp32 activations
    return {"params": parts["params"], "grads": parts["grads"],
            "optimizer": parts["optimizer"], "activations": acts}


def memory_figure(preset: str = "LLaMA 7B", gpus: int = 8, stage: int = 2,
                  precision: str = "mixed", offload: bool = False, checkpoint: bool = True,
                  micro_batch: int = 1, psi: float | None = None, seq_len: int | None = None,
                  cp: int = 1):
    """Stacked bars per GPU for stages 0-3 (the chosen one outlined), against device memory."""
    apply_style()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    top = 0.0
    for s in range(4):
        parts = per_gpu_bytes(preset, gpus, s, precision, offload, checkpoint, micro_batch, psi,
                              seq_len, cp)
        bottom = 0.0
        for name in PARTS:
            gb = parts[name] / 1e9
            ax.bar(s, gb, bottom=bottom, color=PART_COLORS[name],
                   label=name if s == 0 else None,
                   edgecolor="black" if s == stage else "white",
                   linewidth=2 if s == stage else 0.5)
            bottom += gb
        ax.text(s, bottom, f"{bottom:,.1f} GB", ha="center", va="bottom", fontsize=9,
                fontweight="bold" if s == stage else "normal")
        top = max(top, bottom)
    for name, gb in DEVICES_GB.items():
        ax.axhline(gb, color="gray", linestyle=":", linewidth=1)
        ax.text(3.5, gb, name, va="bottom", fontsize=8, color="gray")
    ax.set_xticks(range(4), ["stage 0\n(DP)", "stage 1\n(os)", "stage 2\n(os+g)",
                             "stage 3\n(os+g+p)"])
    ax.set_xlim(-0.6, 4.4)
    if top > 5 * max(DEVICES_GB.values()):  # device lines would be squashed: log scale
        ax.set_yscale("log")
        ax.set_ylim(1, top * 3)
    else:
        ax.set_ylim(0, max(top, max(DEVICES_GB.values())) * 1.12)
    ax.set_ylabel("GB per GPU")
    label = f"{psi / 1e9:g}B params" if psi else preset
    ax.set_title(f"{label} on {gpus} GPU{'s' if gpus != 1 else ''}, {precision}"
                 f"{', offload' if offload else ''}{', checkpointing' if checkpoint else ''}, "
                 f"micro-batch {micro_batch}"
                 + (f", {seq_len:,} tokens" if seq_len else "") + (f", cp {cp}" if cp > 1 else ""))
    ax.legend(loc="upper center", fontsize=8, ncol=4)
    fig.tight_layout()
    return fig


def memory_explorer():
    """Widgets over :func:`memory_figure`: preset or custom size, GPUs, stage, precision,
    offload, activation checkpointing, micro-batch, sequence length, context parallelism."""
    import ipywidgets as widgets

    def show(preset, custom_billions, gpus, stage, precision, offload, checkpoint, micro_batch,
             seq_len, cp):
        psi = custom_billions * 1e9 if custom_billions > 0 else None
        seq = None if seq_len == "preset" else seq_len
        if cp > gpus:
            print(f"context parallelism over {cp} GPUs needs at least {cp} GPUs")
            return
        plt.show(memory_figure(preset, gpus, stage, precision, offload, checkpoint,
                               micro_batch, psi, seq, cp))
        parts = per_gpu_bytes(preset, gpus, stage, precision, offload, checkpoint,
                              micro_batch, psi, seq, cp)
        print("  ".join(f"{k} {v / 1e9:,.2f} GB" for k, v in parts.items()),
              f"| total {sum(parts.values()) / 1e9:,.2f} GB per GPU")

    return full_labels(widgets.interactive(
        show,
        preset=widgets.Dropdown(options=list(PRESETS), value="LLaMA 7B"),
        custom_billions=widgets.FloatText(value=0, description="custom B (0: preset)"),
        gpus=widgets.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
                                     value=8, description="GPUs"),
        stage=widgets.IntSlider(value=2, min=0, max=3, description="stage"),
        precision=widgets.ToggleButtons(options=["mixed", "fp32"], value="mixed"),
        offload=widgets.Checkbox(value=False, description="offload optimizer"),
        checkpoint=widgets.Checkbox(value=True, description="activation checkpointing"),
        micro_batch=widgets.IntSlider(value=1, min=1, max=16, description="micro-batch"),
        seq_len=widgets.SelectionSlider(options=["preset", 8192, 32768, 131072, 1048576],
                                        value="preset", description="sequence length"),
        cp=widgets.SelectionSlider(options=[1, 2, 4, 8, 16, 32], value=1,
                                   description="context parallel"),
    ))


def measured_vs_theory_figure(rows):
    """``rows``: ``[(label, measured StateBytes, theory dict)]``: paired bars per part."""
    apply_style()
    fig, axes = plt.subplots(1, len(rows), figsize=(3 * len(rows), 3.6), sharey=True)
    for ax, (label, measured, expected) in zip(axes, rows, strict=True):
        names = ("params", "grads", "optimizer")
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [getattr(measured, n) / 1e3 for n in names], 0.4,
               label="measured")
        ax.bar([x + 0.2 for x in xs], [expected[n] / 1e3 for n in names], 0.4,
               label="theory", alpha=0.7)
        ax.set_xticks(list(xs), names, fontsize=8)
        ax.set_title(label, fontsize=10)
    axes[0].set_ylabel("KB per rank")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig
