"""The formulas ``python -m engine train`` prints beside what it measures, worked out on each
rank from its live strategy before the first step: the bytes each group should carry per step
(:func:`composed_traffic_formulas`: :func:`engine.compose.formulas.layout_formulas`, the
formulas the parity matrix checks, fp32 elements of 4 B), ZeRO's model states per rank
(Rajbhandari et al., SC 2020), and the model FLOPs of a step for MFU (Megatron-LM's
equation 3 without recomputation; Narayanan et al., SC 2021). The printer is :mod:`engine.train.report`; the
peaks MFU divides by are :mod:`engine.theory.hardware`'s.
"""

from __future__ import annotations

from engine import theory
from engine.compose.formulas import Formula, layout_formulas
from engine.compose.traffic import gradient_group_name, report_names

__all__ = ["Formula", "memory_formula", "model_flops", "gradient_group_name",
           "composed_traffic_formulas"]


def memory_formula(strategy, cfg) -> dict[str, float] | None:
    """ZeRO's per-rank model states for fp32 AdamW (4 + 4 + 8 B per parameter; Rajbhandari et
    al., SC 2020, section 5.1) for this rank's ``psi`` parameters over dp (x cp: the
    composed engine shards over every rank that holds the same parameters)."""
    if not strategy.engine:
        return None
    stage = 0 if cfg.compress is not None else cfg.zero
    return theory.zero_model_state_bytes(strategy.psi, strategy.mesh.dp * strategy.mesh.cp,
                                         stage, k=8,
                                         param_bytes=4, grad_bytes=4)


def model_flops(model_cfg, sequences: int, top_k: int = 1) -> float:
    """The model FLOPs of one step over ``sequences`` sequences: Megatron-LM's equation 3
    without recomputation (``72 B s l h^2 (...)``: only the work the model needs); with
    ``top_k`` experts of ``4h`` per token instead of one MLP, 3 passes of ``4 h f`` more
    for each extra expert."""
    flops = theory.transformer_flops(sequences, model_cfg.seq_len, model_cfg.layers,
                                     model_cfg.hidden, model_cfg.vocab, recompute=False)
    if top_k > 1:
        h, extra = model_cfg.hidden, top_k - 1
        flops += 12 * extra * h * 4 * h * sequences * model_cfg.seq_len * model_cfg.layers
    return flops


def composed_traffic_formulas(strategy, cfg, crossing_rows: int | None = None
                              ) -> dict[str, Formula]:
    """The composed engine's formulas for one step of this rank, under the report's names:
    :func:`engine.compose.formulas.layout_formulas`, the same the parity matrix checks
    (:func:`engine.compose.traffic.report_names`: the gradients over dp x cp named ``dp``,
    ``cp`` or ``dp x cp``). The experts' all-to-alls depend on the routing: their formula
    needs the (token, expert) rows this rank's router sent to other ranks in the counted step
    (``crossing_rows``, counted by the router after the step; None: no ep formula)."""
    par = strategy.rank_state[0].par  # the rank's engine.compose.parallelize.Parallel
    formulas = layout_formulas(par, cfg.micro_batch, steps=1, crossing_rows=crossing_rows)
    return report_names(formulas, strategy.mesh,
                        add=lambda a, b: Formula(a.bytes + b.bytes, f"{a.text}; + {b.text}"))
