"""Checkpoints: one package for the files, the protocol every rank follows, and one failure
protocol for every checkpoint of the engine.

Layers, each importing only those above it in this list:

* :mod:`~engine.checkpoint.files`: atomic writes, reads verified against a SHA-256, the
  manifest (written last: a directory with one holds a complete checkpoint), and
  :class:`CheckpointError`. No process group.
* :mod:`~engine.checkpoint.protocol`: how the ranks save and load together. Every step of a
  save (serialise, write, manifest) and of a load (read and verify, apply) is followed by an
  agreement of every rank, so **any** exception on **any** rank reaches every rank as a
  :class:`CheckpointError` naming the rank and the cause, at once, with every process alive,
  and a failed save leaves no manifest.
* :mod:`~engine.checkpoint.per_rank`: every rank its own whole state (expert parallelism).
* :mod:`~engine.checkpoint.sharded`: the sharded checkpoint's file names and manifest, and
  :mod:`~engine.checkpoint.consolidate`, which joins its shards offline.

Built on them, above this package: ZeRO's sharded save and load
(:mod:`engine.zero.checkpoint`) and the re-cutting of a whole state into ZeRO's buckets
(:mod:`engine.zero.recut`), the trainer's checkpoints (:mod:`engine.checkpoint.trainer`), and
resharding (:mod:`engine.compose.reshard`).
"""

from engine.checkpoint.files import (MANIFEST, CheckpointError, manifest_json, read_verified,
                                     sha256, write_atomically)
from engine.checkpoint.protocol import Agreement, load_files, save_files
from engine.checkpoint.per_rank import load_per_rank, read_rank_state, save_per_rank
from engine.checkpoint.sharded import MeshShape, Place, read_manifest
from engine.checkpoint.consolidate import (DenseOptimizerState, consolidate,
                                           consolidate_optimizer)

__all__ = ["MANIFEST", "CheckpointError", "manifest_json", "read_verified", "sha256",
           "write_atomically", "Agreement", "load_files", "save_files", "load_per_rank",
           "read_rank_state", "save_per_rank", "MeshShape", "Place", "read_manifest",
           "DenseOptimizerState", "consolidate", "consolidate_optimizer"]
