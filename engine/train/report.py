"""What ``python -m engine train`` prints: every measured number beside the formula it checks.

* the resolved configuration, with the values the learner did not choose marked as defaults;
* the batch: sequence length, micro-batch, global batch, tokens per step;
* per implementation: the loss of every step, the step time (median, min, max), tokens/s and
  MFU; the bytes each rank sent per step through each kind of group (dp, tp, pp, the tied
  embedding's), counted on the wire, beside its :mod:`engine.theory` formula; the model-state
  memory of each rank beside ZeRO's formula; the pipeline's idle time beside the simulator
  fed the measured stage times and the bubble formula; a note when ranks doing the same work
  differ in compute share by more than the step-to-step noise.

MFU (model FLOPs utilisation) = model FLOPs per step / (step time x GPUs x peak FLOP/s).
The model FLOPs are Megatron-LM's equation 3 *without* recomputation (``72 B s l h^2 (...)``,
Narayanan et al., SC 2021): only the work the model needs. Counting a recomputed forward too
(``96 ...``) gives hardware FLOPs utilisation (HFU), which is what Megatron's 140 TFLOP/s per
A100 measures. The peak is that of the precision the run trained in, looked up by the GPU's
exact name (an H100 SXM, PCIe and NVL differ), or ``--peak-tflops``; a CPU run has none.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import fields

from engine import theory
from engine.theory.hardware import PEAK_TFLOPS, peak_flops
from engine.compose.model import GPT
from engine.moe.gpt import MOE_MODELS
from engine.pp import build_schedule, measured_bubble, simulate
from engine.model.presets import MODELS
from engine.observe.trace import to_chrome_trace
from engine.train.composed import global_rows, model_config
from engine.train.formulas import Formula, memory_formula, model_flops

# the formulas and the peaks, re-exported where the report's callers found them
__all__ = ["report", "Formula", "memory_formula", "peak_flops", "PEAK_TFLOPS",
           "print_moe_load"]


def report(cfg, results: list[dict], chosen: dict[str, str]) -> dict:
    """Print the report from every rank's results (rank order); return its numbers.
    ``chosen``: the resolved configuration, option -> value text, with "(default)" where the
    learner did not choose it."""
    model_cfg = MODELS[cfg.model]
    first = results[0]
    sequences = global_rows(cfg)
    tokens = sequences * model_cfg.seq_len
    gpt = GPT(model_config(cfg))
    layout = f"dp {cfg.dp} x cp {cfg.cp} x tp {cfg.tp} x pp {cfg.pp}" + \
        (f", ep {cfg.ep} borrowed from dp x cp" if cfg.ep > 1 else "")
    params = sum(p.numel() for p in gpt.parameters())
    print(f"\n{cfg.model} GPT, {params:,} parameters, on {len(results)} rank(s): {layout}; "
          f"{first['device']}, {first['precision']}")
    print("configuration: " + "  ".join(f"--{k} {v}" for k, v in chosen.items()))
    print(f"batch: sequence length {model_cfg.seq_len} tokens; micro-batch {cfg.micro_batch} "
          f"sequences; {cfg.microbatches} micro-batches per step; global batch dp {cfg.dp} x "
          f"{cfg.microbatches} x {cfg.micro_batch} = {sequences} sequences = {tokens:,} tokens "
          "per step" + (" (counted in the loss: the non-padding ones)" if cfg.varlen else ""))
    engine = first.get("engine", {})
    if engine.get("resumed_from"):  # which checkpoint, and (--resume-fallback) which not
        skipped = engine.get("resume_skipped") or []
        print(f"resumed from: {engine['resumed_from']}" + (
            f" (--resume-fallback passed over {'; '.join(skipped)})" if skipped else ""))
    summary = {"tokens_per_step": tokens}
    for impl in ("engine", "torch"):
        if impl in first:
            summary[impl] = _implementation(impl, cfg, model_cfg, results, tokens, sequences)
    if "engine" in summary and "torch" in summary:
        summary["ratio"] = summary["engine"]["tokens_per_s"] / summary["torch"]["tokens_per_s"]
        print(f"engine / torch tokens/s: {summary['ratio']:.2f}x")
    if cfg.trace and "engine" in first:
        to_chrome_trace([e for r in results for e in r["engine"]["events"]], cfg.trace)
        print(f"Chrome trace of the last step: {cfg.trace}")
    return summary


def _implementation(impl, cfg, model_cfg, results, tokens, sequences) -> dict:
    runs = [r[impl] for r in results]
    step_s = runs[0]["step_s"]
    median = statistics.median(step_s)
    peak = peak_flops(results[0]["device"], results[0]["precision"], cfg.peak_tflops)
    top_k = MOE_MODELS[cfg.model]["top_k"] if runs[0].get("moe") else 1
    flops = model_flops(model_cfg, sequences, top_k)
    mfu = flops / (median * len(results) * peak) if peak else None
    first = runs[0].get("first_step", 0)  # > 0: resumed; the steps before, from the checkpoint
    losses = runs[0].get("run_losses", [])[:first] + _losses(runs, cfg)
    print(f"\n[{impl}] {runs[0]['name']}")
    # the same global batch and loss whatever the layout: printed to compare across layouts
    what, digits = "mean over every non-padding token of the global batch", 7
    print(f"  loss per step ({what}): " + ", ".join(
        f"{loss:.{digits}f}" + (_first_label(first, len(losses) - first > len(step_s))
                         if i == first else "") for i, loss in enumerate(losses)))
    print(f"  step time: median {median * 1e3:.1f} ms, min {min(step_s) * 1e3:.1f} ms, max "
          f"{max(step_s) * 1e3:.1f} ms over {len(step_s)} timed step(s) (each the slowest "
          "rank's)")
    print(f"  {tokens / median:,.0f} tokens/s (tokens per step / median step time); "
          + (f"MFU {mfu:.1%} (model FLOPs, no recomputation, at {peak / 1e12:g} TFLOP/s "
             f"{results[0]['precision']} peak)" if mfu is not None else
             "MFU n/a: " + ("a CPU run; --peak-tflops gives one" if results[0]["device"] ==
                            "CPU" else f"no peak known for {results[0]['device']!r}; give "
                            "--peak-tflops")))
    if impl == "engine":
        _compute_shares(runs)
        _traffic_table(runs, results[0]["precision"])
        _memory_table(runs, cfg)
        if runs[0].get("moe"):
            print_moe_load(runs, cfg, model_cfg)
        if cfg.pp > 1:
            _pipeline_line(runs, cfg)
        _compute_share_note(runs)
    return {"step_s": median, "tokens_per_s": tokens / median, "mfu": mfu, "losses": losses}


def _first_label(first: int, warm_up: bool) -> str:
    """The mark on this launch's first step: the warm-up, and where a resumed run began."""
    marks = (["resumed here"] if first else []) + (["warm-up"] if warm_up else [])
    return f" ({', '.join(marks)})" if marks else ""


def _losses(runs, cfg) -> list[float]:
    """Per step, the global loss: every rank computed the same (one all-reduce of its sum)."""
    return list(runs[0]["losses"])


def _size(n: float) -> str:
    return f"{n:,.0f} B"


def _coords(c, composed: bool = False) -> str:
    """A rank's place in the mesh (the composed engine's: with its cp index)."""
    return f"dp{c.dp} cp{c.cp} tp{c.tp} pp{c.pp}" if composed else f"dp{c.dp} tp{c.tp} pp{c.pp}"


def _traffic_table(runs, precision: str) -> None:
    kinds = [k for k in ("dp", "cp", "dp x cp", "tp", "pp", "embedding", "ep", "expert-dp")
             if any(r["traffic"].get(k) or k in r["formulas"] for r in runs)]
    if not kinds:
        return
    counted = all(r["counted"] for r in runs)
    first = runs[0].get("first_step", 0)  # > 0: this launch resumed from a checkpoint
    timed = len(runs[0]["step_s"])
    counted_in = "the warm-up step" if len(runs[0]["losses"]) > timed else "the first step"
    if first:
        counted_in = f"step {first + 1}, this launch's first"
    how = "counted on the wire" if counted else "built-in collectives modeled"
    print(f"  bytes sent per step by each rank, by group, {how} in {counted_in} (the "
          "formula after '='" + ("; it counts 4-byte elements, and bf16 autocast sends some "
                                 "activations in 2" if precision == "bf16" else "") + "):")
    texts: dict[tuple[str, str], list[int]] = {}
    for rank, r in enumerate(runs):
        cells = []
        for kind in kinds:
            formula = r["formulas"].get(kind)
            cells.append(f"{kind} {_size(r['traffic'].get(kind, 0))}" +
                         (f" = {_size(formula.bytes)}" if formula else ""))
            if formula:
                texts.setdefault((kind, formula.text), []).append(rank)
        other = r["traffic"].get("other", 0)
        print(f"    rank {rank} ({_coords(r['coords'], r.get('composed', False))}, "
              f"Ψ = {r['psi']:,}): " +
              "; ".join(cells) + (f"; other groups {_size(other)}" if other else ""))
    for (kind, text), ranks in sorted(texts.items(), key=lambda item: kinds.index(item[0][0])):
        which = "" if len(ranks) == len(runs) else \
            f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
        print(f"    {kind}{which}: {text}")
    with_ep = [r for r in runs if r["formulas"].get("ep")]
    if with_ep:  # one rank sends its rows out and others' back: exact summed over the ranks
        sent = sum(r["traffic"].get("ep", 0) for r in with_ep)
        print(f"    ep summed over the {len(with_ep)} ranks: {_size(sent)} = "
              f"{_size(sum(r['formulas']['ep'].bytes for r in with_ep))} (a rank sends its "
              "own rows out and other ranks' rows back, so the formula is exact summed over "
              "the ranks, per rank only when as many rows come in as go out)")
    if not counted:
        print("    modeled, not counted: " + (
            f"this launch resumed after step {first}, and only a run's first step counts "
            "bytes on the wire; the engine's counted collectives add in another order than "
            "the built-in ones, and a resumed run must compute bit for bit what the "
            "uninterrupted one did. Modeled bytes are the bandwidth-optimal ring's "
            "(engine.theory.collective_wire_bytes); the run from step 1 counts them"
            if first else "some collectives ran on the built-in backend, their bytes "
            "modeled by the bandwidth-optimal ring (engine.theory.collective_wire_bytes)"))


def _memory_table(runs, cfg) -> None:
    if runs[0]["state"] is None:
        return
    stage = 0 if cfg.compress is not None else cfg.zero
    print("  model states per rank, counted by unique storage (formula after '='):")
    for rank, r in enumerate(runs):
        s, f = r["state"], r["memory_formula"]
        print(f"    rank {rank} ({_coords(r['coords'], r.get('composed', False))}, "
              f"Ψ = {r['psi']:,}): params "
              f"{_size(s.params)} = {_size(f['params'])}; grads {_size(s.grads)} = "
              f"{_size(f['grads'])}; optimizer {_size(s.optimizer)} = "
              f"{_size(f['optimizer'])}"
              + ("" if r.get("composed") else f"; activations {_size(r['activations'])}")
              + (f"; CUDA peak {r['cuda_peak'] / 1e9:.3f} GB over the timed steps, "
                 f"{r['cuda_allocated'] / 1e9:.3f} GB allocated once sharded"
                 if r["cuda_peak"] is not None else ""))
    split = {0: "", 1: ", optimizer ÷ dp", 2: ", grads and optimizer ÷ dp",
             3: ", all three ÷ dp"}[stage]
    if stage and runs[0].get("composed"):  # sharded over every rank with the same parameters
        split += " x cp"
    print(f"    formula: params 4 B/param x Ψ, grads 4 B/param, optimizer 8 B/param (AdamW's "
          f"two moments) under ZeRO-{stage}{split}; measured adds bucket padding and AdamW's "
          "step counters")


def _pipeline_line(runs, cfg) -> None:
    """The last step's idle share of the pipeline of the first dp x cp x tp position, measured
    from its ranks' compute events, beside the simulator fed their measured times per action
    (:func:`engine.pp.simulate`) and the bubble formula (p - 1)/(m + p - 1) (Huang et al.
    2019, GPipe, section 2.3)."""
    schedule = build_schedule(cfg.schedule, cfg.pp, cfg.microbatches)
    v = schedule.v
    first = sorted((r for r in runs if (r["coords"].dp, r["coords"].cp, r["coords"].tp) ==
                    (0, 0, 0)), key=lambda r: r["coords"].pp)
    events = [e for r in first for e in r["events"]]

    def per_stage(kind: str) -> list[float]:  # one micro-batch through the whole stage
        return [v * statistics.fmean([e.seconds for e in r["events"]
                                      if e.args["kind"] == kind] or [0.0]) for r in first]

    simulated = simulate(schedule.actions, t_f=per_stage("F"), t_b=per_stage("B"),
                         t_w=per_stage("W"), placement=schedule.placement).bubble
    print(f"  pipeline idle {measured_bubble(events, cfg.pp):.1%} (measured, last step) vs "
          f"{simulated:.1%} (simulator fed the measured stage times) vs "
          f"{theory.bubble_fraction(cfg.pp, cfg.microbatches):.1%} (formula (p-1)/(m+p-1)): "
          "the formula assumes equal stages and free hand-offs, the simulator adds the real "
          "stage times, the rest is sending activations and waiting for them")


def _shares(runs) -> list[list[float]]:
    """Per rank, per timed step: the share of the step it spent in forward and backward."""
    return [[c / s for c, s in zip(r["compute_s"], r["step_s"])] for r in runs]


def _compute_shares(runs) -> None:
    shares = _shares(runs)
    print("  share of the step spent computing (forward + backward), median (min-max) over "
          "the timed steps: " + ", ".join(
              f"rank {i} {statistics.median(x):.0%} ({min(x):.0%}-{max(x):.0%})"
              for i, x in enumerate(shares)))


def _compute_share_note(runs) -> None:
    """A note when ranks with the same work (same pipeline stage) differ in the share of the
    step they spent computing by more than any rank's own step-to-step range."""
    shares = _shares(runs)
    if len(shares[0]) < 2:
        return
    noise = max(max(x) - min(x) for x in shares)
    for stage in sorted({r["coords"].pp for r in runs}):
        ranks = [i for i, r in enumerate(runs) if r["coords"].pp == stage]
        medians = {i: statistics.median(shares[i]) for i in ranks}
        low, high = min(medians, key=medians.get), max(medians, key=medians.get)
        if medians[high] - medians[low] <= noise:
            continue
        a, b = sorted((low, high))
        cores = len(os.sched_getaffinity(0))
        why = (f"{len(runs)} ranks share {cores} CPU cores here, so a rank's compute stretches "
               "while it waits for a core" if runs[0]["device_type"] == "cpu" and
               len(runs) > cores else "a slower device or a busier host")
        print(f"  note: ranks {a} and {b} do the same work but computed "
              f"{medians[a]:.0%} and {medians[b]:.0%} of the step (medians), a gap "
              f"wider than the step-to-step noise ({noise:.0%}): rank {high} computed longer "
              f"({why}), and its peers wait for it in the next collective")


def print_moe_load(runs, cfg, model_cfg) -> None:
    """Per rank: the rows its experts processed per step (every MoE layer it holds, every
    micro-batch) and its tokens' drop rate (0: the composed engine routes dropless); the
    spread over ranks, whose slowest sets the pace."""
    moe = MOE_MODELS[cfg.model]
    tokens = global_rows(cfg) * model_cfg.seq_len // (cfg.dp * cfg.cp)  # one rank's share
    balanced = model_cfg.layers // cfg.pp * tokens * moe["top_k"]  # uniform routing
    print(f"  expert load: rows this rank's experts processed per step, its MoE layers and "
          f"{cfg.microbatches} micro-batches (uniform routing: {balanced:,}); drop rate of "
          "its tokens' assignments:")
    for rank, r in enumerate(runs):
        loads, drops = r["moe"]["loads"], r["moe"]["drop_rates"]
        print(f"    rank {rank} ({_coords(r['coords'], True)}): load min {min(loads):,} / "
              f"mean {statistics.fmean(loads):,.0f} / max {max(loads):,}; drop rate "
              f"{statistics.fmean(drops):.1%}")
    last = [r["moe"]["loads"][-1] for r in runs]
    print(f"    per-rank load, last step: min {min(last):,} / mean {statistics.fmean(last):,.0f}"
          f" / max {max(last):,}: the slowest rank sets the pace")


def resolved(cfg, args, given: set[str], world: int, decided: dict[str, str]
             ) -> dict[str, str]:
    """Each option and its value, marked "(default)" where the learner did not choose it;
    ``decided``: what an "auto" option became. The schedule only for a pipeline."""
    values = {"world_size": world, "backend": args.backend,
              **{f.name: getattr(cfg, f.name) for f in fields(cfg)}}
    shown = {}
    for name, value in values.items():
        if (name == "schedule" and cfg.pp == 1) or \
                ((value is None or value is False) and name not in given) or \
                (name in ("ep", "cp") and getattr(cfg, name) == 1 and name not in given) or \
                (name == "cp_method" and cfg.cp == 1) or \
                (name == "keep" and cfg.save is None):
            continue
        text = f"auto -> {decided[name]}" if value == "auto" and name in decided else str(value)
        shown[name.replace("_", "-")] = text + ("" if name in given else " (default)")
    return shown
