"""Megatron-style tensor parallelism: f/g mappings, column/row-parallel linear layers, a
vocab-parallel embedding and loss; ``sequence_parallel=True`` adds Megatron sequence parallelism
(Korthikanti et al., MLSys 2023). :mod:`engine.tp.layout` is the table of which parameter is cut
on which dimension. These are the kernels :func:`engine.compose.parallelize.parallelize`
applies to the one GPT (its step 1, :func:`engine.compose.parallelize.apply_tensor_parallel`);
chapter 05's TP-vs-ZeRO-3 traffic is :mod:`engine.labs.tp_zero3`."""

from engine.tp.layout import TP_SPLIT, split_dim
from engine.tp.layers import (ColumnParallelLinear, RowParallelLinear,
                              SequenceParallelLayerNorm, SequenceParallelRMSNorm,
                              VocabParallelEmbedding, sequence_parallel_norm,
                              vocab_parallel_cross_entropy)
from engine.tp.mappings import (copy_to_tp, gather_dim, gather_from_sequence_parallel,
                                gather_from_tp, gathered_linear, reduce_from_tp,
                                reduce_scatter_to_sequence_parallel, scatter_to_sequence_parallel,
                                scatter_to_tp)

__all__ = ["copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp",
           "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "SequenceParallelLayerNorm", "SequenceParallelRMSNorm",
           "sequence_parallel_norm",
           "gather_from_sequence_parallel", "reduce_scatter_to_sequence_parallel",
           "scatter_to_sequence_parallel", "gathered_linear", "TP_SPLIT", "split_dim",
           "gather_dim"]
