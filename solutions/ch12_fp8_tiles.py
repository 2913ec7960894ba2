"""Reference for exercise ch12.fp8_tiles (the engine's version is engine/precision/fp8.py,
quantize and dequantize)."""

import torch

_E4M3 = torch.float8_e4m3fn


def _blocks(x, tile):
    rows, cols = x.shape
    tr, tc = tile
    if rows % tr or cols % tc:
        raise ValueError(f"a {tr}x{tc} tile does not divide the shape {tuple(x.shape)}")
    return x.float().reshape(rows // tr, tr, cols // tc, tc)


def quantize_tiles(x, tile):
    blocks = _blocks(x, tile)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    scales = torch.where(amax > 0, amax / torch.finfo(_E4M3).max, torch.ones_like(amax))
    q = (blocks / scales).to(_E4M3).reshape(x.shape)
    return q, scales[:, 0, :, 0]


def dequantize_tiles(q, scales, tile):
    blocks = _blocks(q.float(), tile)
    return (blocks * scales[:, None, :, None]).reshape(q.shape)
