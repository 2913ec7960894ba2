"""Checkpoints: one package for the files, the protocol every rank follows, one failure protocol
for every checkpoint of the engine, and its one on-disk format.

Layers, each importing only those above it in this list:

* :mod:`~engine.checkpoint.files`: atomic writes, reads verified against a SHA-256, the
  manifest (written last: a directory with one holds a complete checkpoint), and
  :class:`CheckpointError`. No process group.
* :mod:`~engine.checkpoint.protocol`: how the ranks save and load together. Every step of a
  save (serialise, write, manifest) and of a load (read and verify, apply) is followed by an
  agreement of every rank, so **any** exception on **any** rank reaches every rank as a
  :class:`CheckpointError` naming the rank and the cause, at once, with every process alive,
  and a failed save leaves no manifest.
* :mod:`~engine.checkpoint.snapshot`: a rank's state taken now and written later (an
  asynchronous save).
* :mod:`~engine.checkpoint.per_rank`: the format. Every rank writes its own state as it holds
  it (its ZeRO shards, tensor-parallel slices, pipeline stage, experts), one file a rank, and
  the manifest lists each file's SHA-256 and each rank's layout.

Built on them, and on the strategies (so in their layer, not imported here): the trainer's
checkpoints (:mod:`engine.checkpoint.trainer`) and the last step of a re-cut, a whole state
into a ZeRO optimizer's buckets (:mod:`engine.checkpoint.recut`). Above them: what a composed
rank saves and where each of its tensors sits in the whole model (:mod:`engine.compose.resume`),
and the universal re-cut (:mod:`engine.compose.reshard`: the files joined offline into the
whole model's ``state_dict`` and AdamW state, then cut for any layout).
"""

from engine.checkpoint.files import (MANIFEST, CheckpointError, manifest_json, read_verified,
                                     sha256, write_atomically)
from engine.checkpoint.protocol import Agreement, load_files, save_files
from engine.checkpoint.per_rank import load_per_rank, read_rank_state, save_per_rank

__all__ = ["MANIFEST", "CheckpointError", "manifest_json", "read_verified", "sha256",
           "write_atomically", "Agreement", "load_files", "save_files", "load_per_rank",
           "read_rank_state", "save_per_rank"]
