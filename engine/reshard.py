"""Resharding: a checkpoint saved at one layout, loaded into another. The engine's answer to
"universal checkpoints".

A sharded checkpoint (:mod:`engine.zero.checkpoint`) fits only the layout it was cut for:
each file is one rank's slice of one tensor- and pipeline-parallel part. To load it into
another layout, go through the whole model, the way DeepSpeed's universal checkpoint does
(it turns the shards into one fp32 "atom" per parameter, plus its optimizer state):

1. **join** (:func:`dense_gpt`, offline, no process group): per part, the dp shards are
   concatenated and cut at the manifest's offsets (:func:`engine.zero.checkpoint.consolidate`
   for the parameters, :func:`~engine.zero.checkpoint.consolidate_optimizer` for AdamW's
   moments and step); then the tp slices of each parameter are joined along the dimension
   Megatron-LM split them on (:data:`engine.tp.layout.TP_SPLIT`, the table the live gather
   :func:`engine.tp.dense_state` reads too; DeepSpeed asks the model for the same table)
   and the pipeline stages' blocks renumbered. The result is named like the dense
   :class:`engine.models.TinyGPT`.
2. **cut** (:func:`load_resharded`, on every rank of the new layout): this rank's part is
   taken from the whole model by the same code that cuts a fresh model
   (:class:`engine.hybrid.GPTStage`, i.e. ``from_dense`` of every tensor-parallel layer),
   once for the parameters and once for each optimizer state, and packed into the new
   buckets by :func:`~engine.zero.checkpoint.load_dense`.

So dp = 4 at ZeRO-3 loads into dp = 2 x tp = 2 at ZeRO-1, and back. What cannot be done is
refused with a :class:`~engine.zero.checkpoint.CheckpointError` naming it: a checkpoint of
another model (a parameter's shape differs), a part missing. A layout the model cannot take
(tp not dividing the heads, more stages than blocks) is refused by the trainer's own checks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from engine.models import GPTConfig, TinyGPT
from engine.pp import uniform_boundaries
from engine.tp.layout import TP_SPLIT, dense_block_name, join  # noqa: F401 - TP_SPLIT kept here
from engine.checkpoint.consolidate import (DenseOptimizerState, consolidate,
                                           consolidate_optimizer)
from engine.checkpoint.files import CheckpointError
from engine.checkpoint.protocol import load_files
from engine.checkpoint.sharded import read_manifest
from engine.zero.recut import load_dense

_BLOCK = re.compile(r"blocks\.(\d+)\.(.*)")


@dataclass
class DenseGPT:
    """A checkpoint joined into the whole model: ``params`` (dense TinyGPT names),
    ``moments`` (each elementwise optimizer state, e.g. AdamW's ``exp_avg``, by the same
    names) and ``per_bucket`` (values the optimizer keeps one of per flat bucket, AdamW's
    ``step``: one number for the whole model)."""

    cfg: GPTConfig
    params: dict[str, torch.Tensor]
    moments: dict[str, dict[str, torch.Tensor]]
    per_bucket: dict[str, torch.Tensor]

    def gpt(self, values: dict[str, torch.Tensor]) -> TinyGPT:
        """A :class:`TinyGPT` whose parameters hold ``values`` (a state tensor as a model,
        so that ``from_dense`` cuts it like the parameters)."""
        model = TinyGPT(self.cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(values[name])
        return model


def dense_gpt(directory, cfg: GPTConfig) -> DenseGPT:
    """Join every part of the checkpoint in ``directory`` into the whole ``cfg`` GPT. Offline."""
    mesh = read_manifest(directory)["mesh"]
    tp, pp = mesh["tp"], mesh["pp"]
    if pp > cfg.layers:
        raise CheckpointError(f"{directory} has {pp} pipeline stages; a GPT of {cfg.layers} "
                              "blocks cannot have been cut that way: a checkpoint of another "
                              "model")
    starts = uniform_boundaries(cfg.layers, pp)
    params: dict[str, list] = {}
    moments: dict[str, dict[str, list]] = {}
    per_bucket: dict[str, set] = {}
    for p in range(pp):
        for t in range(tp):
            part = consolidate(directory, tp=t, pp=p)
            state = consolidate_optimizer(directory, tp=t, pp=p)
            for name, value in part.items():
                _collect(params, _dense_name(name, starts[p]), t, value)
            for key, values in state.elementwise.items():
                for name, value in values.items():
                    _collect(moments.setdefault(key, {}), _dense_name(name, starts[p]), t,
                             value)
            for key, values in state.per_bucket.items():
                per_bucket.setdefault(key, set()).update(float(v) for v in values.values())
    for key, found in per_bucket.items():
        if len(found) != 1:
            raise CheckpointError(f"optimizer state {key!r} differs between the buckets of "
                                  f"{directory}: {sorted(found)}; expected one value")
    return DenseGPT(cfg, _joined(params, cfg, directory),
                    {key: _joined(values, cfg, directory) for key, values in moments.items()},
                    {key: torch.tensor(found.pop()) for key, found in per_bucket.items()})


def _dense_name(name: str, first_block: int) -> str:
    """A part's parameter name as the dense TinyGPT names it."""
    name = name.removeprefix("module.")  # ZeRO-3 wraps the model in Autocast under bf16
    match = _BLOCK.fullmatch(name)
    if not match:
        return name
    rest = dense_block_name(match.group(2))
    return f"blocks.{first_block + int(match.group(1))}.{rest}"


def _collect(into: dict[str, list], name: str, t: int, value: torch.Tensor) -> None:
    """Keep tp rank ``t``'s slice of ``name`` (the first stage's, where two stages hold it)."""
    pieces = into.setdefault(name, [])
    if len(pieces) == t:
        pieces.append(value)


def _joined(pieces: dict[str, list], cfg: GPTConfig, directory) -> dict[str, torch.Tensor]:
    """Each parameter's tp slices joined; named and shaped like ``TinyGPT(cfg)``'s."""
    whole = {name: join(name, slices) for name, slices in pieces.items()}
    whole.setdefault("head.weight", whole.get("tok.weight"))  # tied to the input embedding
    expected = {name: tuple(p.shape) for name, p in
                TinyGPT(cfg).named_parameters(remove_duplicate=False)}
    for name, shape in expected.items():
        got = whole.get(name)
        if got is None or tuple(got.shape) != shape:
            raise CheckpointError(
                f"{directory} holds {name} as {'nothing' if got is None else tuple(got.shape)}"
                f"; a {cfg.layers}-block GPT of hidden {cfg.hidden}, vocabulary {cfg.vocab} "
                f"has it {shape}: a checkpoint of another model")
    extra = sorted(set(whole) - set(expected))
    if extra:
        raise CheckpointError(f"{directory} holds {extra[:3]}, which a {cfg.layers}-block GPT "
                              "does not have: a checkpoint of another model")
    return {name: whole[name] for name in expected}


def reshard(directory, cfg: GPTConfig, strategy) -> None:
    """Join the checkpoint in ``directory`` (:func:`dense_gpt`), then cut this rank's part of
    ``strategy`` from it (:func:`load_resharded`), as the two steps of the checkpoint load
    protocol (:func:`engine.checkpoint.protocol.load_files`): an error on any rank, in either,
    is raised on every rank, naming it. Call on every rank."""
    load_files(directory, lambda: dense_gpt(directory, cfg),
               lambda dense: load_resharded(dense, strategy))


def load_resharded(dense: DenseGPT, strategy) -> None:
    """Load ``dense`` into this rank's part of ``strategy`` (an :class:`engine.strategy.
    Strategy` of any layout): its parameters and its optimizer's state, each cut by
    ``strategy.part_of``, the code that cuts a fresh model. Call on every rank."""
    def named(values):
        return dict(strategy.part_of(dense.gpt(values)).named_parameters(
            remove_duplicate=False))

    params = {name: p.detach() for name, p in named(dense.params).items()}
    moments = {key: {name: p.detach() for name, p in named(values).items()}
               for key, values in dense.moments.items()}
    per_bucket = {key: dict.fromkeys(params, value) for key, value in dense.per_bucket.items()}
    load_dense(strategy.model, strategy.optimizer, params,
               DenseOptimizerState(moments, per_bucket))
