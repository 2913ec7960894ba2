"""Megatron-style tensor parallelism: f/g mappings, column/row-parallel linear layers, a
vocab-parallel embedding and loss, and a tensor-parallel TinyGPT; ``sequence_parallel=True``
adds Megatron sequence parallelism (Korthikanti et al., MLSys 2023). :mod:`engine.tp.layout` is
the table of which parameter is cut on which dimension."""

from engine.tp.blocks import (ParallelAttention, ParallelBlock, ParallelMLP, TensorParallelGPT,
                              check_tp_degree, dense_state, gather_dim, gather_parameter)
from engine.tp.layout import TP_SPLIT, split_dim
from engine.tp.layers import (ColumnParallelLinear, RowParallelLinear,
                              SequenceParallelLayerNorm, VocabParallelEmbedding,
                              vocab_parallel_cross_entropy)
from engine.tp.mappings import (copy_to_tp, gather_from_sequence_parallel, gather_from_tp,
                                gathered_linear, reduce_from_tp,
                                reduce_scatter_to_sequence_parallel, scatter_to_sequence_parallel,
                                scatter_to_tp)
from engine.tp.compare import crossover_tokens, layer_traffic

__all__ = ["copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp",
           "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "ParallelMLP", "ParallelAttention", "ParallelBlock",
           "TensorParallelGPT", "dense_state", "check_tp_degree", "layer_traffic",
           "crossover_tokens", "SequenceParallelLayerNorm", "gather_from_sequence_parallel",
           "reduce_scatter_to_sequence_parallel", "scatter_to_sequence_parallel",
           "gathered_linear", "TP_SPLIT", "split_dim", "gather_dim", "gather_parameter"]
