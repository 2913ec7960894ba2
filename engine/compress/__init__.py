"""Gradient compression as ``DataParallel(compressor=...)`` hooks: casts, sparsification with
error feedback, low rank. See :mod:`engine.compress.base` for the interface."""

from engine.compress.base import Done, Then
from engine.compress.cast import BF16, FP16, Cast
from engine.compress.powersgd import PowerSGD, orthogonalize, should_compress
from engine.compress.topk import RandomK, TopK

__all__ = ["FP16", "BF16", "Cast", "TopK", "RandomK", "PowerSGD", "orthogonalize",
           "should_compress", "Done", "Then"]
