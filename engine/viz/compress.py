"""Compression pictures: loss curves per compressor, and the bytes-vs-quality frontier."""

from __future__ import annotations

import matplotlib.pyplot as plt

from engine.viz.style import apply_style


def _style(spec: str):
    """Colour by method family, dashed without error feedback."""
    kind = spec.split(":")[0]
    palette = {"dense": "black", "fp16": "tab:gray", "bf16": "tab:gray", "topk": "tab:blue",
               "randomk": "tab:cyan", "powersgd": "tab:orange"}
    shades = {"0.1": 1.0, "0.01": 0.7, "0.001": 0.45, "1": 0.6, "4": 1.0}
    parts = spec.split(":")
    alpha = shades.get(parts[1], 1.0) if len(parts) > 1 else 1.0
    return dict(color=palette.get(kind, "tab:red"), alpha=alpha,
                linestyle="--" if spec.endswith("no-ef") else "-")


def compression_figure(results: list[dict]):
    """Left: training loss against step for every run. Right: accuracy against the bytes
    each rank sent (log scale), each run a point: the frontier of bytes vs quality."""
    apply_style()
    fig, (curves, frontier) = plt.subplots(1, 2, figsize=(12, 4.4))
    for r in results:
        steps, losses = zip(*r["losses"])
        curves.plot(steps, losses, label=r["spec"], **_style(r["spec"]))
        style = _style(r["spec"])
        frontier.scatter(r["bytes_sent"] / 2**20, r["accuracy"], color=style["color"],
                         alpha=style["alpha"], marker="o" if style["linestyle"] == "-" else "x",
                         s=50)
        frontier.annotate(r["spec"], (r["bytes_sent"] / 2**20, r["accuracy"]), fontsize=7,
                          xytext=(4, 3), textcoords="offset points")
    curves.set(xlabel="step", ylabel="training loss (all ranks)", yscale="log",
               title="Loss curves (dashed: no error feedback)")
    curves.legend(fontsize=7, ncol=2)
    frontier.set_xscale("log")
    frontier.set_xlabel("MB sent per rank for gradients (log)")
    frontier.set_ylabel("held-out accuracy")
    frontier.set_title("Bytes vs quality (x: no error feedback)")
    fig.tight_layout()
    return fig
