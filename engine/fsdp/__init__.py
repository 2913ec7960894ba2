"""FSDP2 from scratch: per-parameter dim-0 sharding with a mixed-precision policy (chapter 12).

The layers, bottom first::

    policy   MixedPrecisionPolicy(param_dtype, reduce_dtype)
    shard    DimZeroShard: a parameter's rows per rank, the padding outside the Parameter;
             ShardedParam: its shard and the module slots that hold it
    comm     the all-gather and the reduce-scatter of a group, one each per module and pass
    gathered Gathered: a group's whole tensors, freed and filled again in place
    root     which sharded module is the root (decided at the first forward)
    group    ShardGroup: one fully_shard call's hooks: gather, compute, free, reduce-scatter
    step     ShardedStep: what a pipeline step adds (the same whole tensors for every
             micro-batch, zero-bubble's late gradients, the bytes gathered)
    api      fully_shard(module, group, *, reshard_after_forward, mp_policy), full_state_dict

:mod:`engine.labs.fsdp2` trains the tiny GPT with this package, PyTorch's own ``fully_shard``
and the flat-bucket ZeRO-3 side by side; this package is the per-parameter design built here.
"""

from engine.fsdp.api import full_state_dict, fully_shard, gather_full
from engine.fsdp.group import ShardGroup
from engine.fsdp.policy import MixedPrecisionPolicy
from engine.fsdp.shard import DimZeroShard, ShardedParam

__all__ = ["fully_shard", "full_state_dict", "gather_full", "MixedPrecisionPolicy",
           "ShardGroup", "ShardedParam", "DimZeroShard"]
