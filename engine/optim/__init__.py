"""Optimizers built here: Muon, single-process and distributed (chapter 12).

The layers, bottom first::

    newton_schulz   the quintic iteration (Keller Jordan's coefficients) and its FLOPs
    muon            Muon (momentum, Newton-Schulz, shape scale); split_params for AdamW
    distributed     DistributedMuon: each matrix owned by one rank (reduce-scatter by owner,
                    orthogonalise whole, all-gather); the naive row-shard version measured
    gathered        GatherMuon: Moonlight's Algorithm 1 (ZeRO-1's even slices, every matrix
                    gathered and orthogonalised on every rank, each keeping its slice)

:mod:`engine.labs.muon` measures both beside Muon and ZeRO-2 AdamW (parameters, bytes, FLOPs
per rank).
"""

from engine.optim.distributed import (DistributedMuon, assign_owners, naive_error,
                                      row_shard_update)
from engine.optim.gathered import GatherMuon
from engine.optim.muon import Muon, muon_update, shape_scale, split_params
from engine.optim.newton_schulz import COEFFICIENTS, newton_schulz, newton_schulz_flops

__all__ = ["Muon", "DistributedMuon", "GatherMuon", "newton_schulz", "newton_schulz_flops",
           "COEFFICIENTS", "muon_update", "shape_scale", "split_params", "assign_owners",
           "row_shard_update", "naive_error"]
