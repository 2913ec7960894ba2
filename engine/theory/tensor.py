"""Tensor parallelism (chapter 05).

Part of :mod:`engine.theory`: pure formulas, each naming its source; sizes in bytes.
"""

from __future__ import annotations

from engine.theory.collectives import check_n


def tp_comm_elements_per_layer(b: int, s: int, h: int, t: int) -> float:
    """Elements each rank sends per transformer layer per micro-batch under Megatron tensor
    parallelism of degree ``t``: four ring all-reduces (two forward, two backward) of
    ``b*s*h`` activations each, ``4 * 2(t-1)/t * bsh = 8bsh(t-1)/t`` (Shoeybi et al. 2019,
    section 3; Narayanan et al., SC 2021, section 3.2)."""
    check_n(t)
    return 8 * b * s * h * (t - 1) / t


def zero3_comm_elements_per_layer(h: int, t: int) -> float:
    """The same for ZeRO-3 over ``t`` ranks, per layer per step: ``3(t-1)/t`` times the
    layer's ``12h^2 + 13h`` parameters (the four weight matrices, their biases and two
    LayerNorms: Narayanan et al. 2021, equation 2, per layer) for two all-gathers and one
    reduce-scatter, independent of the batch (Rajbhandari et al. 2020, section 7)."""
    check_n(t)
    return 3 * (t - 1) / t * (12 * h * h + 13 * h)


def tp_zero3_crossover_tokens(h: int) -> float:
    """Tokens per micro-batch (``b*s``) at which tensor parallelism and ZeRO-3 send the same per
    layer, whatever ``t``: :func:`tp_comm_elements_per_layer`'s ``8bsh(t-1)/t`` (Shoeybi et al.
    2019, section 3) equals ``3(t-1)/t`` times the layer's ``12h^2 + 13h`` parameters (weights,
    biases and two LayerNorms; two all-gathers and a reduce-scatter, Rajbhandari et al. 2020,
    section 7) at ``b*s = 3(12h^2 + 13h) / (8h)``, about ``4.5 h``."""
    return 3 * (12 * h * h + 13 * h) / (8 * h)
