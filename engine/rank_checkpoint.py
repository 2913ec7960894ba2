"""Per-rank checkpoints, under their old import path: they live in
:mod:`engine.checkpoint.per_rank` (every rank its own whole state; expert parallelism)."""

from engine.checkpoint.files import MANIFEST, CheckpointError
from engine.checkpoint.per_rank import (KIND, load_per_rank, rank_file, read_per_rank_manifest,
                                        read_rank_state, save_per_rank, state_layout)

__all__ = ["KIND", "MANIFEST", "CheckpointError", "load_per_rank", "rank_file",
           "read_per_rank_manifest", "read_rank_state", "save_per_rank", "state_layout"]
