"""FP8 matmuls, emulated: per-tensor, per-row and DeepSeek-V3's tile scaling.

Numerics only, not speed: there is no FP8 hardware here. Values are cast to
``torch.float8_e4m3fn`` (4 exponent bits, 3 mantissa bits, max 448) or ``torch.float8_e5m2``
(max 57344), each group of values first divided by a scale that maps its largest magnitude to
the format's maximum; the product is then computed from the dequantized values in fp32, as a
tensor core accumulates FP8 products in higher precision. Which format for which tensor is a
recipe's choice: E4M3 forward and E5M2 for gradients is the hybrid of Micikevicius et al.
("FP8 Formats for Deep Learning", 2022) and Transformer Engine; DeepSeek-V3 uses E4M3 for every
tensor, its fine-grained scales making E5M2's range unnecessary.

Who shares a scale decides how much one outlier costs everyone else:

* ``"tensor"``: one scale per operand. An outlier channel in the activations sets the scale for
  all of them, and the small values fall into FP8's subnormals or to zero.
* ``"row"``: one per row of ``a`` (a token) and one per column of ``b`` (an output channel).
* ``"block"``: DeepSeek-V3's fine-grained quantization (DeepSeek-AI, "DeepSeek-V3 Technical
  Report", 2024, section 3.3.2): ``a`` (activations, ``M x K``) in 1x128 tiles along ``K``,
  ``b`` (weights, ``K x N``) in 128x128 blocks. An outlier sets the scale of its own tile only;
  and a group of 128 along ``K`` is the interval at which DeepSeek-V3 promotes the tensor
  cores' partial sums to fp32 on the CUDA cores, where each group's scales are applied.

The three differ in both operands at once; :func:`scaling_grid` varies the activations' scaling
under one weight scaling at a time, to tell what each operand's scales cost.
"""

from __future__ import annotations

import torch

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SCALINGS = ("tensor", "row", "block")
TILE = 128  # DeepSeek-V3: 1 x 128 activation tiles, 128 x 128 weight blocks


def fp8_dtype(fmt: str) -> torch.dtype:
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r}; expected one of {tuple(FORMATS)}")
    return FORMATS[fmt]


def scale_for(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 scale that maps ``amax`` onto ``dtype``'s largest finite value (1 where the
    block is all zeros): every FP8 cast of this package divides by it."""
    return torch.where(amax > 0, amax / torch.finfo(dtype).max, torch.ones_like(amax))


def quantize(x: torch.Tensor, tile: tuple[int, int], fmt: str = "e4m3"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (2-D) in FP8, one fp32 scale per ``tile`` (rows, cols) block: returns
    ``(q, scales)`` with ``x ~= q.float() * scales`` broadcast over each block."""
    dtype = fp8_dtype(fmt)
    if x.dim() != 2:
        raise ValueError(f"quantize takes a 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    tr, tc = tile
    if rows % tr or cols % tc:
        raise ValueError(f"a {tr}x{tc} tile does not divide the shape {tuple(x.shape)}: "
                         f"{rows} % {tr} = {rows % tr}, {cols} % {tc} = {cols % tc}")
    blocks = x.float().reshape(rows // tr, tr, cols // tc, tc)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    scales = scale_for(amax, dtype)
    q = (blocks / scales).to(dtype).reshape(rows, cols)
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values ``q`` (from :func:`quantize`) stands for."""
    rows, cols = q.shape
    br, _, bc, _ = scales.shape
    blocks = q.float().reshape(br, rows // br, bc, cols // bc)
    return (blocks * scales).reshape(rows, cols)


def tiles(scaling: str, a_shape, b_shape, tile: int = TILE
          ) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (rows, cols) of the tiles sharing a scale in ``a`` (M x K) and in ``b`` (K x N):
    ``"block"`` is ``1 x tile`` for ``a`` and ``tile x tile`` for ``b``."""
    (m, k), (_, n) = a_shape, b_shape
    if scaling == "tensor":
        return (m, k), (k, n)
    if scaling == "row":
        return (1, k), (k, 1)
    if scaling == "block":
        return (1, tile), (tile, tile)
    raise ValueError(f"scaling={scaling!r}; expected one of {SCALINGS}")


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, scaling: str = "tensor",
               fmt: str = "e4m3", *, fmt_b: str | None = None, tile: int = TILE
               ) -> torch.Tensor:
    """``a @ b`` (``M x K`` by ``K x N``) with both operands quantized to FP8 under
    ``scaling`` (``a`` in ``fmt``, ``b`` in ``fmt_b``, default the same) and the products
    accumulated in fp32 (emulated); the result in fp32. ``tile``: the block side (128 as
    DeepSeek-V3; smaller for a tiny model)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"fp8_matmul takes M x K and K x N, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    tile_a, tile_b = tiles(scaling, a.shape, b.shape, tile)
    qa, sa = quantize(a, tile_a, fmt)
    qb, sb = quantize(b, tile_b, fmt_b or fmt)
    return dequantize(qa, sa) @ dequantize(qb, sb)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` (Frobenius): dominated by the largest tokens."""
    return ((approx - exact).norm() / exact.norm()).item()


def token_relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """The mean over rows (tokens) of each row's relative error: every token counts alike,
    the small ones that a shared scale flushes too."""
    return ((approx - exact).norm(dim=1) / exact.norm(dim=1)).mean().item()


def outlier_activations(m: int = 256, k: int = 512, outlier: float = 100.0,
                        channel: int = 7, spread: float = 2.0, seed: int = 0) -> torch.Tensor:
    """Activations with one outlier channel ``outlier`` times the others (LLM activations
    have a few: Dettmers et al., "LLM.int8()", 2022) and token norms from ``10**-spread`` to
    ``10**spread``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator)
    x *= torch.logspace(-spread, spread, m).unsqueeze(1)  # tokens of very different norms
    x[:, channel] *= outlier
    return x


def scaling_errors(a: torch.Tensor, b: torch.Tensor, fmt: str = "e4m3",
                   metric=token_relative_error) -> dict[str, float]:
    """The error against fp32 (``metric``) of :func:`fp8_matmul` under each scaling."""
    exact = a.float() @ b.float()
    return {s: metric(fp8_matmul(a, b, s, fmt), exact) for s in SCALINGS}


ACTIVATION_SCALINGS = ("tensor", "row", "tile")  # a: one scale, one per row, one per 1 x tile
WEIGHT_SCALINGS = ("fp32", "tensor", "column", "block")  # b: none, one, per column, tile x tile


def _operand_tile(scaling: str, shape, tile: int) -> tuple[int, int] | None:
    rows, cols = shape
    return {"fp32": None, "tensor": (rows, cols), "row": (1, cols), "tile": (1, tile),
            "column": (rows, 1), "block": (tile, tile)}[scaling]


def scaling_grid(a: torch.Tensor, b: torch.Tensor, fmt: str = "e4m3", tile: int = TILE,
                 metric=token_relative_error) -> dict[str, dict[str, float]]:
    """``{activation scaling: {weight scaling: error}}`` of ``a @ b`` against fp32 (``metric``),
    ``a`` quantized per tensor, per row or in ``1 x tile`` tiles, under each scaling of ``b``:
    none (``"fp32"``, the activations' error alone), per tensor, per column, ``tile x tile``
    blocks. Within one column only the activations' scales change."""
    exact = a.float() @ b.float()
    weights = {}
    for w in WEIGHT_SCALINGS:
        shape = _operand_tile(w, b.shape, tile)
        weights[w] = b.float() if shape is None else dequantize(*quantize(b, shape, fmt))
    return {s: {w: metric(dequantize(*quantize(a, _operand_tile(s, a.shape, tile), fmt))
                          @ weights[w], exact) for w in WEIGHT_SCALINGS}
            for s in ACTIVATION_SCALINGS}
