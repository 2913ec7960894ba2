"""Pipeline pictures: a Gantt chart per stage (simulated or measured) and an explorer over
every schedule the engine has, zero-bubble ones included."""

from __future__ import annotations

import matplotlib.pyplot as plt

from engine.pp.registry import SCHEDULES as REGISTRY, build_schedule
from engine.viz.style import apply_style, full_labels

KIND_COLORS = {"F": "#1f77b4", "B": "#2ca02c", "W": "#ff7f0e"}


def timeline_rows(events) -> list[tuple]:
    """Measured :class:`engine.observe.trace.TraceEvent` s from :func:`engine.pp.run_pipeline` as the
    simulator's rows ``(stage, kind, mb, chunk, start, end)``."""
    return [(e.rank, e.args["kind"], e.args["mb"], e.args["chunk"], e.start, e.end)
            for e in events]


def gantt_figure(timeline, title: str = "", ax=None, unit: str = "time", legend: bool = True):
    """One row per stage; forward boxes blue, backward green, weight gradients (W, in a
    zero-bubble schedule) orange, lighter for later chunks, labelled with the micro-batch;
    white space is the bubble."""
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
        split = any(r[1] == "W" for r in timeline)
        handles = [Patch(color=KIND_COLORS["F"], label="forward (micro-batch)"),
                   Patch(color=KIND_COLORS["B"],
                         label="B: input gradient" if split else "backward")]
        if split:
            handles.append(Patch(color=KIND_COLORS["W"], label="W: weight gradient"))
        if any(r[3] for r in timeline):
            handles.append(Patch(color=KIND_COLORS["F"], alpha=0.65,
                                 label="lighter: second model chunk"))
        handles.append(Patch(facecolor="white", edgecolor="gray", label="idle (bubble)"))
        ax.legend(handles=handles, fontsize=7, ncol=len(handles), loc="lower center",
                  bbox_to_anchor=(0.5, 1.0), borderaxespad=0.1, handlelength=1.5)
    if own_figure:
        ax.figure.tight_layout()
    return ax.figure


# the explorer's buttons: each registered schedule's label -> its name in the registry
SCHEDULES = {spec.label: name for name, spec in REGISTRY.items()}


def formula_line(name: str, p: int, m: int, v: int, t_f: float, t_b: float, t_w: float) -> str:
    """The closed-form bubble for schedule ``name``, where there is one, as text."""
    from engine import theory

    if name in ("GPipe", "1F1B", "interleaved 1F1B"):
        return f"formula (p-1)/(vm+p-1) = {theory.bubble_fraction(p, m, v):.1%}"
    if name == "ZB-H1" and m >= p and t_w <= min(t_f, t_b):
        fraction = theory.zb_h1_bubble_fraction(p, m, t_f, t_b, t_w)
        return f"ZB-H1 formula (p-1)(F+B-W) over the total = {fraction:.1%}"
    if name == "ZB-H1":
        return "the ZB-H1 formula needs m >= p and W <= F, B"
    if name == "ZB-H2" and m >= 2 * p - 1 and t_w <= min(t_f, t_b):
        idle = theory.zb_h2_bubble_time(p, t_f, t_b, t_w)
        return (f"ZB-H2 formula (p-1)(F+B-2W) = {idle:g} idle per stage per step with steps "
                "back to back (post-validation); one step alone also waits out its slanted "
                "start and end")
    if name == "ZB-H2":
        return "the ZB-H2 formula needs m >= 2p-1 and W <= F, B"
    return "no closed form used here: simulated"


def pipeline_explorer():
    """Widgets over the simulator: schedule, p, m, v (interleaved), the input-gradient (B) and
    weight-gradient (W) times relative to the forward, and a message delay; shows the Gantt
    chart, the bubble next to its formula, and the micro-batches held per stage. Schedules
    without W run B and W as one backward of time B + W."""
    import ipywidgets as widgets

    from engine.pp import simulate

    def show(schedule, p, m, v, b_over_f, w_over_f, t_comm):
        try:
            built = build_schedule(SCHEDULES[schedule], p, m, v)
        except ValueError as e:
            print(f"not valid: {e}")
            return
        chunks = built.v
        result = simulate(built.actions, t_f=1.0, t_b=b_over_f, t_w=w_over_f, t_comm=t_comm,
                          placement=built.placement)
        fig = gantt_figure(result.timeline, f"{schedule}: p={p}, m={m}" +
                           (f", v={chunks}" if chunks > 1 else "") +
                           f"; bubble {result.bubble:.1%} of total time", unit="time (t_f = 1)")
        plt.show(fig)
        print(f"bubble: {result.bubble:.1%} of total ({result.bubble_vs_ideal():.1%} of ideal);"
              f" {formula_line(schedule, p, m, chunks, 1.0, b_over_f, w_over_f)}"
              + (" (without communication)" if t_comm else ""))
        print("per stage, micro-batches held for B (activations) / until W, in whole-stage "
              "units: " + ", ".join(
                  f"{s}: {result.peak_in_flight[s] / chunks:g} / {result.peak_held[s] / chunks:g}"
                  for s in result.peak_in_flight))

    return full_labels(widgets.interactive(
        show,
        schedule=widgets.ToggleButtons(options=list(SCHEDULES), value="1F1B"),
        p=widgets.IntSlider(value=4, min=1, max=8, description="stages p"),
        m=widgets.IntSlider(value=8, min=1, max=32, description="micro-batches m"),
        v=widgets.IntSlider(value=2, min=1, max=4, description="chunks v (interleaved)"),
        b_over_f=widgets.FloatSlider(value=1.0, min=0.5, max=4.0, step=0.25,
                                     description="B (input grad) / F"),
        w_over_f=widgets.FloatSlider(value=1.0, min=0.0, max=4.0, step=0.25,
                                     description="W (weight grad) / F"),
        t_comm=widgets.FloatSlider(value=0.0, min=0.0, max=1.0, step=0.1,
                                   description="comm time"),
    ))
