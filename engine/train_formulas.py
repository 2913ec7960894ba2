"""The formulas ``python -m engine train`` prints beside what it measures, worked out on each
rank from its live strategy before the first step: the bytes each group should carry per step
(:mod:`engine.theory`, fp32 elements of 4 B), ZeRO's model states per rank (Rajbhandari et al.,
SC 2020), and the model FLOPs of a step for MFU (Megatron-LM's equation 3 without
recomputation; Narayanan et al., SC 2021). The printer is :mod:`engine.train_report`; the
peaks MFU divides by are :mod:`engine.hardware`'s.
"""

from __future__ import annotations

from types import SimpleNamespace

from engine import theory
from engine.compose.formulas import Formula, compressed_dp_formula, layout_formulas
from engine.compose.traffic import gradient_group_name, report_names
from engine.pp import uniform_boundaries
from engine.pp.link import SHAPE_HEADER_BYTES
from engine.train_compose import plan_of

__all__ = ["Formula", "traffic_formulas", "pipeline_formulas", "zero3_formula",
           "memory_formula", "model_flops", "gradient_group_name", "composed_traffic_formulas"]


def traffic_formulas(strategy, cfg, model_cfg) -> dict[str, Formula]:
    """Bytes this rank should send in one step through each group of more than one rank, by
    :mod:`engine.theory` (fp32 elements, 4 B). Called before the first step (a compressor's
    state is then the one the counted step starts from)."""
    mesh = strategy.mesh
    out = {}
    if mesh.dp > 1:
        out["dp"] = _dp_formula(strategy, cfg)
    if mesh.tp > 1:
        out["tp"] = _tp_formula(mesh, cfg, model_cfg)
    if mesh.pp > 1:
        out.update(pipeline_formulas(mesh, cfg, model_cfg))
    return out


def pipeline_formulas(mesh, cfg, model_cfg) -> dict[str, Formula]:
    """The activations and their gradients between stages (``pp``) and the tied embedding's
    all-reduce between the first and the last stage (``embedding``)."""
    out = {}
    if mesh.pp > 1:
        b, s, h, m = cfg.micro_batch, model_cfg.seq_len, model_cfg.hidden, cfg.microbatches
        sends = (not mesh.is_last_stage) + (not mesh.is_first_stage)
        headers = 0 if mesh.is_last_stage else SHAPE_HEADER_BYTES
        out["pp"] = Formula(m * sends * b * s * h * 4 + headers,
                            f"m x {sends} direction(s) x bsh x 4 B" + (
                                f" + one {SHAPE_HEADER_BYTES} B shape header (the activations' "
                                "shape travels once per step)" if headers else ""))
        if mesh.is_first_stage or mesh.is_last_stage:
            v = model_cfg.vocab // mesh.tp
            out["embedding"] = Formula(theory.ring_all_reduce_bytes(v * h * 4, 2),
                                       f"2(2-1)/2 x (V/t) h x 4 B, an all-reduce of the tied "
                                       f"embedding's gradient between the first and the last "
                                       f"stage (theory.ring_all_reduce_bytes); V/t = {v}")
    return out


def _dp_formula(strategy, cfg) -> Formula:
    n, m, psi = strategy.mesh.dp, cfg.microbatches, strategy.psi
    if cfg.compress is not None:
        return _compressed_formula(strategy.model, n)
    if cfg.zero == 3:
        return zero3_formula(strategy.model, psi, n, m)
    if cfg.zero == 2:
        tied = _tied_bucket(strategy)
        return Formula(m * theory.ring_reduce_scatter_bytes(psi * 4, n) +
                       theory.ring_all_gather_bytes((psi + tied) * 4, n),
                       f"ZeRO-2: (m+1)(N-1)/N x Ψ x 4 B: a reduce-scatter in each of the m = "
                       f"{m} backwards (no whole gradient is kept to accumulate into), one "
                       f"all-gather after the step; N = {n}" + (
                           f"; + (N-1)/N x {tied:,} x 4 B on the first and last stage: the "
                           "tied embedding's bucket, its gradient gathered to be summed over "
                           "the two stages" if tied else ""))
    return Formula(theory.zero_comm_elements(psi, n, cfg.zero) * 4,
                   f"ZeRO-{cfg.zero}: 2(N-1)/N x Ψ x 4 B (theory.zero_comm_elements), once per "
                   f"step (gradients accumulate over the m micro-batches); N = {n}")


def zero3_formula(model, psi: int, n: int, m: int) -> Formula:
    """ZeRO-3's bytes per step over ``n`` ranks, ``model`` a
    :class:`engine.zero.ZeroDataParallel` whose root unit is gathered once per step."""
    root = model.root
    kept = sum(shape.numel() for shape in root.shapes.values()) if root else 0
    return Formula(
        m * (theory.zero_comm_elements(psi, n, 3) - (n - 1) / n * kept) * 4,
        f"ZeRO-3: m x (N-1)/N x (3Ψ - Ψ_root) x 4 B: per micro-batch two all-gathers "
        f"(forward, backward) and one reduce-scatter (theory.zero_comm_elements), except "
        f"the root unit's Ψ_root = {kept:,} parameters (what is outside the blocks: the "
        f"embeddings, the final norm, the tied head), gathered once "
        f"and kept through backward; N = {n}, m = {m}")


def _tied_bucket(strategy) -> int:
    """Elements of the ZeRO-2 bucket holding the tied embedding, on a first or last pipeline
    stage (:meth:`engine.hybrid.GPTStage.sync_tied_embedding` gathers it); else 0."""
    mesh, weight = strategy.mesh, getattr(strategy.model, "tok", None)
    if mesh.pp == 1 or weight is None or not (mesh.is_first_stage or mesh.is_last_stage):
        return 0
    return strategy.optimizer.launcher.bucket_of[weight.weight].padded


def _tp_formula(mesh, cfg, model_cfg) -> Formula:
    """Megatron's four all-reduces per layer, plus the embedding's (first stage), the output
    layer's and the vocab-parallel loss's three of one number per token (last stage)."""
    b, s, h, m, t = cfg.micro_batch, model_cfg.seq_len, model_cfg.hidden, cfg.microbatches, \
        mesh.tp
    first, last = mesh.is_first_stage, mesh.is_last_stage
    starts = uniform_boundaries(model_cfg.layers, mesh.pp) + [model_cfg.layers]
    layers = starts[mesh.coords.pp + 1] - starts[mesh.coords.pp]
    per_mb = layers * theory.tp_comm_elements_per_layer(b, s, h, t) + \
        (first + last) * theory.ring_all_reduce_bytes(b * s * h, t) + \
        last * 3 * theory.ring_all_reduce_bytes(b * s, t)
    parts = [f"8bsh(t-1)/t x {layers} layers"] + \
        (["2bsh(t-1)/t embedding"] if first else []) + \
        (["2bsh(t-1)/t output layer", "3 x 2bs(t-1)/t loss"] if last else [])
    return Formula(m * per_mb * 4, f"m x ({' + '.join(parts)}) x 4 B "
                                   "(theory.tp_comm_elements_per_layer, ring_all_reduce_bytes); "
                                   f"b = {b}, s = {s}, h = {h}, t = {t}")


_compressed_formula = compressed_dp_formula  # its home is engine.compose.formulas


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


def composed_traffic_formulas(strategy, cfg) -> dict[str, Formula]:
    """The composed engine's formulas for one step of this rank, under the report's names:
    :func:`engine.compose.formulas.layout_formulas`, the same the parity matrix checks
    (:func:`engine.compose.traffic.report_names`: the gradients over dp x cp named ``dp``,
    ``cp`` or ``dp x cp``). The experts' all-to-alls depend on the routing, unknown before the
    step: no ep formula here (``python -m engine parity`` gives it from the routers' counts)."""
    module = strategy.model
    par = SimpleNamespace(plan=plan_of(cfg), mesh=strategy.mesh, module=module,
                          model=getattr(module, "module", module), optimizer=strategy.optimizer)
    formulas = layout_formulas(par, cfg.micro_batch, steps=1)
    return report_names(formulas, strategy.mesh,
                        add=lambda a, b: Formula(a.bytes + b.bytes, f"{a.text}; + {b.text}"))
