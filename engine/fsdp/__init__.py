"""FSDP2 from scratch: per-parameter dim-0 sharding with a mixed-precision policy (chapter 12).

The layers, bottom first::

    policy   MixedPrecisionPolicy(param_dtype, reduce_dtype)
    shard    DimZeroShard: a parameter's rows per rank, the padding outside the Parameter
    group    ShardGroup: one fully_shard call's hooks, the all-gather and the reduce-scatter
    api      fully_shard(module, group, *, reshard_after_forward, mp_policy), full_state_dict

:mod:`engine.labs.fsdp2` trains the tiny GPT with this package, PyTorch's own ``fully_shard``
and the flat-bucket ZeRO-3 side by side; this package is the per-parameter design built here.
"""

from engine.fsdp.api import full_state_dict, fully_shard, gather_full
from engine.fsdp.group import ShardGroup, ShardedParam
from engine.fsdp.policy import MixedPrecisionPolicy
from engine.fsdp.shard import DimZeroShard

__all__ = ["fully_shard", "full_state_dict", "gather_full", "MixedPrecisionPolicy",
           "ShardGroup", "ShardedParam", "DimZeroShard"]
