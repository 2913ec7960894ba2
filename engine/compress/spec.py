"""Compressors named by strings, so a run is easy to launch and to label (``engine train
--compress SPEC``, chapter 03's experiment): ``"dense"``, ``"fp16"``, ``"bf16"``,
``"topk:0.01"`` (with error feedback), ``"topk:0.01:no-ef"``, ``"randomk:0.01"``,
``"powersgd:4"``.
"""

from __future__ import annotations

from engine.compress.cast import BF16, FP16
from engine.compress.powersgd import PowerSGD
from engine.compress.topk import RandomK, TopK

EXAMPLES = ("dense", "fp16", "bf16", "topk:0.01", "topk:0.01:no-ef", "randomk:0.01",
            "powersgd:4")


def make_compressor(spec: str):
    """The compressor a run's name stands for (``None`` for dense)."""
    kind, *rest = spec.split(":")
    try:
        if kind == "dense" and not rest:
            return None
        if kind in ("fp16", "bf16") and not rest:
            return FP16() if kind == "fp16" else BF16()
        if kind in ("topk", "randomk") and rest and rest[1:] in ([], ["no-ef"]):
            cls = TopK if kind == "topk" else RandomK
            return cls(float(rest[0]), error_feedback=rest[1:] != ["no-ef"])
        if kind == "powersgd" and len(rest) == 1:
            return PowerSGD(int(rest[0]), start_iter=0)  # compress from the first step
    except ValueError as e:
        raise ValueError(f"bad compressor spec {spec!r}: {e}") from None
    raise ValueError(f"unknown compressor spec {spec!r}; expected one like {', '.join(EXAMPLES)}")
