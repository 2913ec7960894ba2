"""Pipeline pictures: a Gantt chart per stage (simulated or measured) and an explorer."""

from __future__ import annotations

import matplotlib.pyplot as plt

from engine.viz.style import apply_style, full_labels

KIND_COLORS = {"F": "#1f77b4", "B": "#2ca02c"}


def timeline_rows(events) -> list[tuple]:
    """Measured :class:`engine.trace.TraceEvent` s from :func:`engine.pp.run_pipeline` as the
    simulator's rows ``(stage, kind, mb, chunk, start, end)``."""
    return [(e.rank, e.args["kind"], e.args["mb"], e.args["chunk"], e.start, e.end)
            for e in events]


def gantt_figure(timeline, title: str = "", ax=None, unit: str = "time", legend: bool = True):
    """One row per stage; forward boxes blue, backward green (lighter for later chunks),
    labelled with the micro-batch; white space is the bubble."""
    from matplotlib.patches import Patch

    apply_style()
    own_figure = ax is None
    if own_figure:
        _, ax = plt.subplots(figsize=(9, 0.5 * (1 + max(r[0] for r in timeline)) + 1.5))
    t0 = min(r[4] for r in timeline)
    p = 1 + max(r[0] for r in timeline)
    width = max(r[5] for r in timeline) - t0
    for stage, kind, mb, chunk, start, end in timeline:
        ax.barh(p - 1 - stage, end - start, left=start - t0, height=0.7,
                color=KIND_COLORS[kind], alpha=1.0 - 0.35 * chunk, edgecolor="white",
                linewidth=0.6)
        if (end - start) > 0.012 * width:
            ax.text(start - t0 + (end - start) / 2, p - 1 - stage, str(mb), ha="center",
                    va="center", fontsize=7, color="white")
    ax.set_yticks(range(p), [f"stage {s}" for s in reversed(range(p))])
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=10, pad=16 if legend else 6)
    ax.grid(axis="y", visible=False)
    if legend:
        handles = [Patch(color=KIND_COLORS["F"], label="forward (micro-batch)"),
                   Patch(color=KIND_COLORS["B"], label="backward")]
        if any(r[3] for r in timeline):
            handles.append(Patch(color=KIND_COLORS["F"], alpha=0.65,
                                 label="lighter: second model chunk"))
        handles.append(Patch(facecolor="white", edgecolor="gray", label="idle (bubble)"))
        ax.legend(handles=handles, fontsize=7, ncol=len(handles), loc="lower center",
                  bbox_to_anchor=(0.5, 1.0), borderaxespad=0.1, handlelength=1.5)
    if own_figure:
        ax.figure.tight_layout()
    return ax.figure


def pipeline_explorer():
    """Widgets over the simulator: p, m, v, schedule, backward/forward time ratio and
    communication time; shows the Gantt chart, the bubble and the activations in flight."""
    import ipywidgets as widgets

    from engine import theory
    from engine.pp import gpipe, interleaved_1f1b, one_f_one_b, simulate

    def show(schedule, p, m, v, tb_over_tf, t_comm):
        try:
            if schedule == "interleaved 1F1B":
                plan = interleaved_1f1b(p, m, v)
            else:
                plan = (gpipe if schedule == "GPipe" else one_f_one_b)(p, m)
                v = 1
        except ValueError as e:
            print(f"not valid: {e}")
            return
        result = simulate(plan, t_f=1.0, t_b=tb_over_tf, t_comm=t_comm)
        fig = gantt_figure(result.timeline, f"{schedule}: p={p}, m={m}" +
                           (f", v={v}" if schedule == "interleaved 1F1B" else "") +
                           f"; bubble {result.bubble:.1%} of total time", unit="time (t_f = 1)")
        plt.show(fig)
        print(f"bubble: {result.bubble:.1%} of total ({result.bubble_vs_ideal():.1%} of ideal);"
              f" formula without communication {theory.bubble_fraction(p, m, v):.1%}")
        print("peak micro-batches in flight per stage (activations held): "
              + ", ".join(f"{s}: {n}" for s, n in result.peak_in_flight.items()))

    return full_labels(widgets.interactive(
        show,
        schedule=widgets.ToggleButtons(options=["GPipe", "1F1B", "interleaved 1F1B"],
                                       value="1F1B"),
        p=widgets.IntSlider(value=4, min=1, max=8, description="stages p"),
        m=widgets.IntSlider(value=8, min=1, max=32, description="micro-batches m"),
        v=widgets.IntSlider(value=2, min=1, max=4, description="chunks v"),
        tb_over_tf=widgets.FloatSlider(value=2.0, min=0.5, max=4.0, step=0.5,
                                       description="t_b / t_f"),
        t_comm=widgets.FloatSlider(value=0.0, min=0.0, max=1.0, step=0.1,
                                   description="comm time"),
    ))
