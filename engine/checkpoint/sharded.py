"""The sharded checkpoint's layout on disk: which file holds which shard, and the manifest that
lists them. What ZeRO's save and load (:mod:`engine.zero.checkpoint`) and the offline
consolidation (:mod:`engine.checkpoint.consolidate`) agree on.

Tensor and pipeline parallelism cut the model into ``tp x pp`` *parts*
(:class:`engine.topology.Mesh`); each part is held by one data-parallel group, which shards
its flat buckets (Rajbhandari et al., ZeRO, SC 2020, section 5). Rank ``d`` of the dp group
at tensor-parallel index ``t`` and pipeline stage ``p`` writes

    tp{t}-pp{p}-rank{d}-of{dp}.pt    (``rank{d}-of{dp}.pt`` when tp = pp = 1)

and ``manifest.json`` records the format, the mesh (dp, tp, pp), the ZeRO stage, whether the
files are shards or whole copies, each part's bucket layout (where every parameter sits in
its bucket) and the SHA-256 of every file.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from engine.checkpoint.files import MANIFEST, CheckpointError, manifest_json, read_verified

FORMAT = 2  # manifest version: 2 records the mesh and one bucket layout per part


class MeshShape(NamedTuple):
    """The sizes of the mesh a checkpoint was cut for."""

    dp: int
    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        return f"dp x tp x pp = {self.dp} x {self.tp} x {self.pp}"


class Place(NamedTuple):
    """One shard file's place: the model part (``tp``, ``pp``) and the rank in its dp group."""

    tp: int
    pp: int
    dp: int


def part_key(tp: int, pp: int) -> str:
    return f"tp{tp}-pp{pp}"


def file_name(shape: MeshShape, place: Place) -> str:
    part = "" if shape.tp == shape.pp == 1 else part_key(place.tp, place.pp) + "-"
    return f"{part}rank{place.dp}-of{shape.dp}.pt"


def read_manifest(directory) -> dict:
    """The manifest of the sharded checkpoint in ``directory``, checked: a
    :class:`CheckpointError` if there is none (a save that did not finish), it is
    unreadable, or of another format."""
    path, manifest = Path(directory) / MANIFEST, manifest_json(Path(directory))
    missing = {"format", "mesh", "stage", "parts", "files"} - set(manifest)
    if missing or manifest["format"] != FORMAT:
        raise CheckpointError(f"{path} is not a format-{FORMAT} manifest (missing "
                              f"{sorted(missing)}, format {manifest.get('format')}): save the "
                              "checkpoint again with this version")
    return manifest


def read_shard(directory, manifest: dict, name: str, map_location) -> dict:
    """Shard file ``name``, checked against ``manifest`` (:func:`read_manifest`)."""
    path, shape = Path(directory) / name, MeshShape(**manifest["mesh"])
    expected = f"the manifest lists {len(manifest['files'])} shard files ({shape})"
    if name not in manifest["files"]:
        raise CheckpointError(f"{path} is not in the manifest: {expected}")
    return read_verified(path, manifest["files"][name], expected, map_location)


def saved_part(directory, manifest: dict, key: str) -> dict:
    """Part ``key``'s layout as the manifest records it (its buckets and buffers)."""
    if key not in manifest["parts"]:
        raise CheckpointError(f"{Path(directory) / MANIFEST} has no part {key}, only "
                              f"{sorted(manifest['parts'])}")
    return manifest["parts"][key]
