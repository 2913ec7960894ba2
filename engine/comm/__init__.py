"""Communication: metered wrappers, the ``CommMeter``, and collectives built from p2p sends.

Strategies call collectives through :mod:`engine.comm.ops` so that a :class:`CommMeter` open on
the rank sees every byte. The ring, the parameter server, the tree and the all-to-all are built
from the point-to-point ops, so their traffic is counted, not modeled; inside
``CommMeter(count="wire")`` every collective the engine issues runs on them
(:mod:`engine.comm.counted`).
"""

from engine.comm import ops
from engine.comm.all_to_all import pairwise_all_to_all
from engine.comm.meter import CommEvent, CommMeter
from engine.comm.ps import ps_all_reduce
from engine.comm.ring import chunk_sizes, ring_all_gather, ring_all_reduce, ring_reduce_scatter
from engine.comm.ring_pipelined import (RingBuffers, ring_all_gather_pipelined,
                                        ring_all_reduce_pipelined,
                                        ring_reduce_scatter_pipelined)
from engine.comm.tree import tree_all_reduce

__all__ = ["CommMeter", "CommEvent", "ops", "ring_all_reduce", "ring_reduce_scatter",
           "ring_all_gather", "ring_all_reduce_pipelined", "ring_reduce_scatter_pipelined",
           "ring_all_gather_pipelined", "RingBuffers", "chunk_sizes",
           "ps_all_reduce", "tree_all_reduce", "pairwise_all_to_all"]
