"""The planner, drawn: memory per GPU and step-time breakdown of the best configurations."""

from __future__ import annotations

import dataclasses

import matplotlib.pyplot as plt

from engine.theory.planner import GPUS, MODELS, Cluster, plan
from engine.viz.style import apply_style, full_labels
from engine.viz.zero import PART_COLORS

TIME_COLORS = {"compute": "#1f77b4", "tp": "#ff7f0e", "ep": "#8c564b", "cp": "#17becf",
               "bubble": "#d62728", "pp": "#9467bd", "dp": "#2ca02c"}
CP_DEGREES = (1, 2, 4, 8, 16, 32, 64)


def plans_table(plans, top: int = 10) -> str:
    lines = [f"{'#':>2}  {'configuration':<42}{'GB/GPU':>8}{'step s':>8}   time: compute / tp / "
             "ep / cp / bubble / pp / dp"]
    for i, p in enumerate(plans[:top], 1):
        t = p.time
        lines.append(f"{i:>2}  {p.label():<42}{p.memory['total'] / 1e9:>8.1f}{t['total']:>8.2f}"
                     f"   {t['compute']:.2f} / {t['tp']:.2f} / {t.get('ep', 0):.2f} / "
                     f"{t.get('cp', 0):.2f} / {t['bubble']:.2f} / {t['pp']:.2f} / "
                     f"{t['dp']:.2f}")
    return "\n".join(lines)


def plans_figure(plans, memory_gb: float, top: int = 6, title: str = ""):
    """Left: memory per GPU by part; right: step time by part, for the ``top`` plans (fastest
    first)."""
    apply_style()
    shown = plans[:top]
    labels = [p.label().replace(" ZeRO", "\nZeRO") for p in shown]
    fig, (mem, tim) = plt.subplots(1, 2, figsize=(12, 0.55 * len(shown) + 1.8), sharey=True)
    for i, p in enumerate(shown):
        left = 0.0
        for part in ("params", "grads", "optimizer", "activations"):
            gb = p.memory[part] / 1e9
            mem.barh(i, gb, left=left, color=PART_COLORS[part], label=part if i == 0 else None)
            left += gb
        left = 0.0
        for part, color in TIME_COLORS.items():
            tim.barh(i, p.time[part], left=left, color=color, label=part if i == 0 else None)
            left += p.time[part]
    mem.axvline(memory_gb, color="gray", linestyle=":", label="GPU memory")
    mem.set_yticks(range(len(shown)), labels, fontsize=8)
    mem.invert_yaxis()
    mem.set_xlabel("GB per GPU")
    tim.set_xlabel("seconds per step")
    for ax in (mem, tim):
        ax.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=5)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def planner_explorer():
    """Widgets: model, GPU type, GPU count, GPUs per node, NVLink and network bandwidth per
    GPU, global batch, MFU, sequence length, the largest context-parallel degree to try and
    sequence parallelism; the ranked table and the figure."""
    import ipywidgets as widgets

    def show(model, gpu, gpus, gpus_per_node, nvlink_gbps, network_gbps, global_batch, mfu,
             seq_len, max_cp, sequence_parallel):
        specs = dict(GPUS[gpu], intra_gbps=nvlink_gbps, inter_gbps=network_gbps)
        cluster = Cluster(gpus, gpus_per_node=gpus_per_node, **specs)
        spec = dataclasses.replace(MODELS[model], seq_len=seq_len)
        plans = plan(spec, cluster, global_batch, mfu,
                     cp_degrees=tuple(c for c in CP_DEGREES if c <= max_cp),
                     sequence_parallel=sequence_parallel)
        if not plans:
            print(f"nothing fits: {model} on {gpus} x {gpu} with a global batch of "
                  f"{global_batch}")
            return
        print(f"{len(plans)} configurations fit; the fastest:")
        print(plans_table(plans))
        plt.show(plans_figure(plans, cluster.memory_gb, title=(
            f"{model} on {gpus} x {gpu}, global batch {global_batch}: the "
            f"{min(6, len(plans))} fastest plans that fit")))

    return full_labels(widgets.interactive(
        show,
        model=widgets.Dropdown(options=list(MODELS), value="GPT-3 175B"),
        gpu=widgets.Dropdown(options=list(GPUS), value="A100 80GB"),
        gpus=widgets.SelectionSlider(options=[8, 16, 32, 64, 128, 256, 512, 1024, 2048],
                                     value=1024, description="GPUs"),
        gpus_per_node=widgets.SelectionSlider(options=[1, 2, 4, 8, 16], value=8,
                                              description="GPUs/node"),
        nvlink_gbps=widgets.FloatSlider(value=300, min=25, max=900, step=25,
                                        description="NVLink GB/s"),
        network_gbps=widgets.FloatSlider(value=25, min=5, max=100, step=5,
                                         description="network GB/s"),
        global_batch=widgets.SelectionSlider(options=[256, 512, 1024, 1536, 2048, 4096],
                                             value=1536, description="global batch"),
        mfu=widgets.FloatSlider(value=0.45, min=0.2, max=0.7, step=0.05, description="MFU"),
        seq_len=widgets.SelectionSlider(options=[2048, 4096, 8192, 32768, 131072],
                                        value=2048, description="sequence length"),
        max_cp=widgets.SelectionSlider(options=list(CP_DEGREES), value=1,
                                       description="context parallel up to"),
        sequence_parallel=widgets.Checkbox(value=False, description="sequence parallel"),
    ))
