"""The engine's own algorithm for every collective, used while a meter counts the wire.

:func:`engine.comm.ops.all_reduce` and its peers (:mod:`engine.comm.collectives`) run the
built-in collective normally. Inside ``CommMeter(count="wire")`` they call the function of the
same name here instead, which does the same job with point-to-point messages
(:mod:`engine.comm.p2p`, never the collectives above), so every byte is counted:

=================  ================================  ===================================
collective         algorithm                         bytes sent per rank (S = full size)
=================  ================================  ===================================
all_reduce         ring (see below)                  2(N-1)/N·S
reduce_scatter     ring reduce-scatter               (N-1)/N·S
all_gather         ring all-gather                   (N-1)/N·S
broadcast          chain from the root               S, except the chain's last rank
reduce             chain towards the root            S, except the root
all_to_all         pairwise exchange                 S less the piece a rank keeps
=================  ================================  ===================================

The same ops as the built-ins (sum, avg, max, min) and the same results: integer-valued inputs
give the same bits (tests/test_counted.py and tests/test_counted_strategies.py check every
strategy both ways).

Which ring: a sum or average on Gloo runs the tuned ring
(:func:`engine.comm.ring_all_reduce_pipelined`): the same algorithm and the same messages as
the readable one, counted the same way, in about half the time of a training run (a dense
300-step run on 4 ranks: 4.7-6.4 s against 9.7-11.8 s). On NCCL, for max and min, and for
dtypes the tuned ring's checks do not list (int8, uint8, ...), the readable ring
(:mod:`engine.comm.ring`) runs: the tuned one posts receives ahead of their sends, which can
block NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.comm import p2p
from engine.comm.all_to_all import pairwise_all_to_all
from engine.comm.checks import SUPPORTED_DTYPES
from engine.comm.ring import COMBINE, all_gather_steps, reduce_scatter_steps
from engine.comm.ring_pipelined import ring_all_reduce_pipelined


def op_name(op) -> str:
    """``dist.ReduceOp.SUM``/``AVG``/``MAX``/``MIN`` as the ring's name for it."""
    for name in ("SUM", "AVG", "MAX", "MIN"):
        if op == getattr(dist.ReduceOp, name):
            return name.lower()
    raise ValueError(f"the counted collectives reduce with SUM, AVG, MAX or MIN, got {op!r}")


def _me_and_n(group) -> tuple[int, int]:
    ranks = p2p.group_ranks(group)
    return ranks.index(dist.get_rank()), len(ranks)


def all_reduce(tensor: torch.Tensor, op, group) -> None:
    name = op_name(op)
    if name in ("sum", "avg") and tensor.dtype in SUPPORTED_DTYPES and \
            dist.get_backend(group) != "nccl":
        ring_all_reduce_pipelined(tensor.view(-1), group, name, check=False)
        return
    me, n = _me_and_n(group)
    chunks = list(tensor.view(-1).tensor_split(n))
    reduce_scatter_steps(chunks, group, COMBINE[name])
    if name == "avg":
        chunks[me].div_(n)
    all_gather_steps(chunks, group)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op, group) -> None:
    name = op_name(op)
    me, n = _me_and_n(group)
    if input.numel() != n * output.numel():
        raise ValueError(f"reduce_scatter: the input has {input.numel()} elements, expected "
                         f"{n} x the output's {output.numel()}")
    chunks = list(input.detach().clone().view(-1).split(output.numel()))
    reduce_scatter_steps(chunks, group, COMBINE[name])
    output.view(-1).copy_(chunks[me].div_(n) if name == "avg" else chunks[me])


def all_gather(output: torch.Tensor, input: torch.Tensor, group) -> None:
    me, n = _me_and_n(group)
    if output.numel() != n * input.numel():
        raise ValueError(f"all_gather: the output has {output.numel()} elements, expected "
                         f"{n} x the input's {input.numel()}")
    chunks = list(output.view(-1).split(input.numel()))
    chunks[me].copy_(input.reshape(-1))
    all_gather_steps(chunks, group)


def broadcast(tensor: torch.Tensor, src: int, group) -> None:
    """A chain from the root: each rank receives from the one before it and sends on."""
    ranks = p2p.group_ranks(group)
    n, start = len(ranks), ranks.index(src)
    position = (ranks.index(dist.get_rank()) - start) % n
    if position > 0:
        p2p.recv(tensor, ranks[(start + position - 1) % n], group)
    if position < n - 1:
        p2p.send(tensor, ranks[(start + position + 1) % n], group)


def reduce(tensor: torch.Tensor, dst: int, op, group) -> None:
    """A chain towards the root: each rank adds what arrives from behind it and passes it on.
    Only the root's tensor changes (the others' inputs are left as they were)."""
    combine = COMBINE[op_name(op)]
    ranks = p2p.group_ranks(group)
    n, start = len(ranks), ranks.index(dst)
    position = (ranks.index(dist.get_rank()) - start) % n
    partial = tensor if position == 0 else tensor.detach().clone()
    if position < n - 1:
        incoming = torch.empty_like(tensor)
        p2p.recv(incoming, ranks[(start + position + 1) % n], group)
        combine(partial, incoming)
    if position > 0:
        p2p.send(partial, ranks[(start + position - 1) % n], group)
    elif op_name(op) == "avg":
        tensor.div_(n)


def all_to_all(output, input, output_split_sizes, input_split_sizes, group) -> None:
    pairwise_all_to_all(output, input, output_split_sizes, input_split_sizes, group)
