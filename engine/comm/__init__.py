"""Communication: metered wrappers and collectives built from p2p sends.

Strategies call collectives through :mod:`engine.comm.ops` so that a
:class:`engine.observe.meter.CommMeter` open on the rank sees every byte. The ring, the
parameter server, the tree and the all-to-all are built from the point-to-point ops, so their
traffic is counted, not modeled; inside ``CommMeter(count="wire")`` every collective the
engine issues runs on them (:mod:`engine.comm.counted`).

The layers, top down; each imports only the layers below it::

    ops                  the facade the rest of the engine calls (re-exports, no code)
    autograd             the differentiable all-to-all (MoE dispatch, Ulysses), on ops
    collectives          all_reduce, broadcast, ...: the built-in (bytes modeled), or
                         inside CommMeter(count="wire") the counted algorithm
    counted              the engine's algorithm for every collective, from the ones below
    ring, ring_pipelined, tree, ps, all_to_all
                         the algorithms, built on p2p only
    p2p                  send/recv/isend/irecv/batch_isend_irecv, counted exactly; host
                         staging for Gloo with CUDA tensors; group_ranks, MeteredWork
    checks               the input and cross-rank agreement checks of the p2p collectives

Below this package, :mod:`engine.observe` holds what every op reports to and what checks it:
the meter (``CommMeter``), how an event's times were obtained (``durations``), NCCL's rules
and the patcher of ``torch.distributed``.

:mod:`engine.comm.timing` times the all-reduce algorithms side by side (benchmarks, ch. 01).
"""

from engine.comm import ops
from engine.comm.all_to_all import pairwise_all_to_all
from engine.comm.ps import ps_all_reduce
from engine.comm.ring import chunk_sizes, ring_all_gather, ring_all_reduce, ring_reduce_scatter
from engine.comm.ring_pipelined import (RingBuffers, ring_all_gather_pipelined,
                                        ring_all_reduce_pipelined,
                                        ring_reduce_scatter_pipelined)
from engine.comm.tree import tree_all_reduce

__all__ = ["ops", "ring_all_reduce", "ring_reduce_scatter", "ring_all_gather",
           "ring_all_reduce_pipelined", "ring_reduce_scatter_pipelined",
           "ring_all_gather_pipelined", "RingBuffers", "chunk_sizes", "ps_all_reduce",
           "tree_all_reduce", "pairwise_all_to_all"]
