"""Exercise ch12.fp8_tiles: FP8 (E4M3) quantization with one scale per tile.

Fill in ``quantize_tiles`` and ``dequantize_tiles``, save, then run ``check("ch12.fp8_tiles")``
in course/12_precision_memory.ipynb (or ``make grade``). They are checked on shapes and tiles
you do not see: DeepSeek-V3's 1 x 128 activation tiles and 128 x 128 weight blocks, smaller
tiles, and an input with an outlier channel; and on a tile that does not divide the shape.
"""

import torch  # noqa: F401  (you will need it)


def quantize_tiles(x, tile):
    """``x`` (2-D, ``rows x cols``) in ``torch.float8_e4m3fn`` with one fp32 scale per
    ``tile = (tr, tc)`` block.

    Each block's scale is its largest magnitude divided by E4M3's largest value, 448
    (``torch.finfo(torch.float8_e4m3fn).max``), or 1 for a block of zeros; the block divided
    by its scale is cast to E4M3. Return ``(q, scales)``: ``q`` shaped as ``x``, ``scales``
    fp32 shaped ``(rows // tr, cols // tc)``, block ``(i, j)`` covering rows ``i*tr ...`` and
    columns ``j*tc ...``.

    A tile that does not divide the shape raises ``ValueError`` with a message that names the
    tile and the shape.
    """
    raise NotImplementedError("ch12.fp8_tiles: write me")


def dequantize_tiles(q, scales, tile):
    """The fp32 values ``q`` stands for: each block of ``q.float()`` times its scale."""
    raise NotImplementedError("ch12.fp8_tiles: write me")
