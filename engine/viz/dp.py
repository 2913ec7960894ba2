"""Data-parallel pictures: how gradients are packed into buckets."""

from __future__ import annotations

import matplotlib.pyplot as plt
import torch

from engine.dp.buckets import assign_buckets
from engine.viz.style import apply_style, full_labels


def buckets_figure(module: torch.nn.Module, bucket_cap_mb: float):
    """Each parameter tensor as a block, in the order backward produces its gradient (last
    layer first), coloured by the bucket it joins."""
    apply_style()
    params = [p for p in module.parameters() if p.requires_grad]
    buckets = assign_buckets(params, int(bucket_cap_mb * 2**20))
    names = {p: n for n, p in module.named_parameters()}
    colors = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(8, 2.4))
    left = 0.0
    for i, bucket in enumerate(buckets):
        for p in bucket:
            width = p.numel() * p.element_size() / 2**20
            ax.barh(0, width, left=left, color=colors[i % 10], edgecolor="white")
            if width > 0.04 * sum(q.numel() * q.element_size() for q in params) / 2**20:
                ax.text(left + width / 2, 0, names[p], ha="center", va="center", fontsize=7,
                        rotation=90, color="white")
            left += width
    ax.set_yticks([])
    ax.set_xlabel("MB of gradients, in the order backward produces them (last layer first)")
    ax.set_title(f"bucket_cap_mb={bucket_cap_mb:g}: {len(buckets)} bucket(s), one all-reduce each")
    fig.tight_layout()
    return fig


def buckets_explorer(module: torch.nn.Module):
    """A slider over ``bucket_cap_mb`` for :func:`buckets_figure`."""
    import ipywidgets as widgets

    return full_labels(widgets.interactive(
        lambda bucket_cap_mb: plt.show(buckets_figure(module, bucket_cap_mb)),
        bucket_cap_mb=widgets.FloatLogSlider(value=1, base=10, min=-2, max=2, step=0.1,
                                             description="cap (MB)")))
