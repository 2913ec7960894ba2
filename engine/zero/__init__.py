"""ZeRO from scratch: sharded optimizer state (stage 1), gradients (stage 2) and parameters
(stage 3) over flat, evenly padded buckets."""

from engine.zero.flat import FlatBucket, make_buckets
from engine.zero.optimizer import ZeroOptimizer
from engine.zero.stage3 import ZeroDataParallel
from engine.zero.tuned import TunedZeroOptimizer
from engine.zero.hsdp import HybridShardedDataParallel

__all__ = ["ZeroOptimizer", "TunedZeroOptimizer", "ZeroDataParallel", "FlatBucket",
           "make_buckets", "HybridShardedDataParallel"]
