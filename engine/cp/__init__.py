"""Context parallelism (chapter 09): the sequence split over ranks, attention still exact.

* :func:`ring_attention`: K/V blocks passed round a ring, merged by online softmax (Liu et al.
  2023), in the contiguous, the load-balanced zig-zag, or the striped layout (Brandon et al.
  2023: token t on rank t mod N);
* :func:`ulysses_attention`: two all-to-alls switch to whole heads over the whole sequence
  (Jacobs et al. 2023), KV heads replicated when N does not divide them;
* :func:`allgather_attention`: every rank all-gathers K/V (Llama 3, section 3.3.2; PyTorch's
  ``context_parallel`` default), dK/dV reduce-scattered;
* :func:`usp_attention`: Ulysses inside a group, ring across ("USP", Fang & Zhao 2024);
* :class:`BufferCount`: the working buffers each method holds, counted;
* :func:`rank_document_pairs`: each rank's work under a packed-document mask, per layout;
* :func:`shard_sequence` / :func:`gather_sequence`: a rank's part of a sequence and back.

These are the kernels :func:`engine.compose.parallelize.parallelize` applies to the one GPT (its
step 2, :func:`engine.compose.parallelize.apply_context_parallel`: each attention's ``core``).
Megatron sequence parallelism, which splits only the LayerNorm/dropout regions of a
tensor-parallel layer, lives in :mod:`engine.tp` (``sequence_parallel=True``).
"""

from engine.cp.allgather import allgather_attention
from engine.cp.buffers import BufferCount
from engine.cp.documents import document_imbalance, document_mask, rank_document_pairs
from engine.cp.layout import (LAYOUTS, check_sequence_split, gather_sequence, rank_chunks,
                              shard_indices, shard_sequence)
from engine.cp.ring import block_pairs, ring_attention, ring_schedule
from engine.cp.twod import usp_attention, usp_groups, usp_indices
from engine.cp.ulysses import check_ulysses_heads, ulysses_attention

__all__ = ["ring_attention", "ulysses_attention", "shard_sequence", "gather_sequence",
           "shard_indices", "rank_chunks", "check_sequence_split", "check_ulysses_heads",
           "ring_schedule", "block_pairs", "LAYOUTS", "allgather_attention", "usp_attention",
           "usp_groups", "usp_indices", "BufferCount", "document_mask", "rank_document_pairs",
           "document_imbalance"]
