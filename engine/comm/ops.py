"""The wrappers over ``torch.distributed`` the rest of the engine calls: every op reported to
the open meters.

``from engine.comm import ops; ops.all_reduce(grad)``. Same arguments and semantics as the
``torch.distributed`` functions of the same name (ranks are global ranks, as there). This module
is a facade and holds no code: the point-to-point ops, counted exactly, are
:mod:`engine.comm.p2p`; the collectives, which run the built-in and record modeled wire bytes
except inside ``CommMeter(count="wire")``, where they run on the engine's own point-to-point
algorithms (:mod:`engine.comm.counted`) and their bytes are counted, are
:mod:`engine.comm.collectives` (see :mod:`engine.observe.meter`).

**Gloo with CUDA tensors.** Gloo takes CUDA tensors only in ``all_reduce`` and ``broadcast``;
for every other op the data goes through host memory and back (:mod:`engine.comm.p2p`), which
lets a one-GPU machine run the multi-rank lessons on Gloo with CUDA tensors. On NCCL, and for
CPU tensors, nothing is copied.

The algorithms inside :mod:`engine.comm` (the ring, the tree, ...) do not import this module:
they are built on :mod:`engine.comm.p2p`, one layer down.
"""

from __future__ import annotations

from engine.comm.collectives import (CompletedWork, ReduceOp, all_gather_into_tensor,
                                     all_reduce, all_to_all_single, barrier, broadcast, reduce,
                                     reduce_scatter_tensor)
from engine.comm.p2p import (MeteredWork, P2POp, batch_isend_irecv, group_ranks, irecv, isend,
                             nbytes, process_group_and_rank, recv, recv_op, send, send_op,
                             stages_through_host, staged)

__all__ = [
    # point to point (engine.comm.p2p)
    "P2POp", "MeteredWork", "group_ranks", "nbytes", "stages_through_host", "staged",
    "process_group_and_rank", "send", "recv", "isend", "irecv", "send_op", "recv_op",
    "batch_isend_irecv",
    # collectives (engine.comm.collectives)
    "ReduceOp", "CompletedWork", "all_reduce", "broadcast", "reduce", "reduce_scatter_tensor",
    "all_gather_into_tensor", "all_to_all_single", "barrier",
]
