"""``--reshard`` on the composed engine: a checkpoint of one layout resumed on another, through
a dense, layout-free state (the engine's "universal checkpoint").

The per-rank files of :mod:`engine.compose.resume` fit only their own layout: each holds one
rank's tensor-parallel slices, pipeline stage and ZeRO shards. To resume another layout, go
through the whole model, as DeepSpeed's universal checkpoint does (Lian et al. 2024,
"Universal Checkpointing", section 3: per-parameter fp32 "atoms" of the weights and of the
optimizer state, joined from any source layout, sliced for any target one) and as PyTorch's
distributed checkpoint does with each tensor's recorded placement:

1. **join** (:func:`universal_state`, offline, no process group): every rank recorded where
   each of its tensors sits in the dense GPT (:func:`engine.compose.resume.placement`). A
   ZeRO-1/2 shard is joined with the other shards of its bucket (the ranks recorded, in their
   order) and cut at the parameter's offset, a ZeRO-3 shard with the other rows of its
   parameter (:mod:`engine.fsdp`: each shard a parameter's rows); then the tensor-parallel
   slices of each parameter are joined on the dimension Megatron-LM split it on (:func:`engine.tp.layout.join`, the one
   table :data:`engine.tp.layout.TP_SPLIT`; the fused ``[q | k | v]`` by heads, as
   :func:`engine.compose.state.join_tp` joins it live).
   The same for every elementwise optimizer state (AdamW's ``exp_avg``, ``exp_avg_sq``: they
   lie in a bucket exactly as their parameters do); AdamW's ``step`` is one number. The result
   is named like the one-process :class:`engine.compose.model.GPT`.
2. **cut** (:func:`load_universal`, on every rank of the new layout): a GPT holding the dense
   values is cut by the functions that cut a fresh model (steps 1, 3 and 4 of
   :func:`engine.compose.parallelize.parallelize`: tensor parallelism, expert parallelism, the
   pipeline split; context parallelism changes no parameter), once for the parameters and once
   for each optimizer state, and loaded into this rank's data-parallel wrapper: its ZeRO
   buckets by :func:`engine.checkpoint.recut.load_dense`, a plain AdamW (ZeRO-3's over its dim-0
   shards, cut from the whole) by its ``load_state_dict``.

So any change of dp, cp (and its method), ep, tp, pp (and the schedule), ZeRO stage,
micro-batches and micro-batch size resumes with AdamW's state carried over: experts are
recorded under their global index (:func:`engine.compose.state.global_expert_name`), their
ZeRO shards with the expert-data-parallel ranks, and cut by expert parallelism's own split.
The losses after it equal one process's within the parity matrix's 1e-6, not bit for bit: the
new layout sums in another order (tests/test_compose_reshard.py). What stays refused, by name:
``--compress`` (:func:`engine.train.composed.check_composed_reshard`, and a compressed
checkpoint when it is joined), as the error-feedback residual is one rank's memory of its own
gradients: no rank of another layout continues it; a model with buffers (DeepSeek-V3's
expert bias, ``bias_update_rate``: the trainer's models have none), which this state does not
carry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.checkpoint.files import CheckpointError
from engine.checkpoint.per_rank import read_per_rank_manifest, read_rank_state
from engine.checkpoint.protocol import load_files
from engine.checkpoint.recut import DenseOptimizerState, load_dense
from engine.compose.experts import Optimizers, apply_expert_parallel
from engine.compose.model import GPT, ModelConfig
from engine.compose.parallelize import Parallel, apply_tensor_parallel
from engine.compose.pipeline import apply_pipeline
from engine.tp.layout import join, qkv_sizes
from engine.zero import ZeroOptimizer


@dataclass
class UniversalState:
    """A composed checkpoint joined into the whole model: ``params`` (one process's names),
    ``moments`` (each elementwise optimizer state by the same names) and ``scalars`` (the
    optimizer states that are one number, AdamW's ``step``)."""

    params: dict[str, torch.Tensor]
    moments: dict[str, dict[str, torch.Tensor]]
    scalars: dict[str, torch.Tensor]


def join_slices(name: str, slices: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The dense ``name`` from its tensor-parallel ``slices`` (rank order), offline: the join of
    :func:`engine.compose.state.join_tp` without the all-gather (:func:`engine.tp.layout.join`,
    which reads the one split table)."""
    return join(name, slices, qkv_sizes(cfg.heads, cfg.kv_heads_or_heads, cfg.head_dim))


def universal_state(directory, cfg: ModelConfig) -> UniversalState:
    """Join the composed per-rank checkpoint in ``directory`` into the dense ``cfg`` GPT's
    parameters and optimizer state (module docstring, step 1). Offline."""
    world = read_per_rank_manifest(directory)["world_size"]
    payloads: dict[int, dict] = {}

    def payload(rank: int) -> dict:
        if rank not in payloads:
            payloads[rank] = read_rank_state(directory, rank)
        return payloads[rank]

    pieces: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    scalars: dict[str, set[float]] = {}
    degrees = set()
    for rank in range(world):
        place = payload(rank).get("optimizer", {}).get("placement")
        if place is None:
            raise CheckpointError(f"rank {rank}'s file in {directory} records no placement of "
                                  "its tensors (saved before engine.compose.reshard existed): "
                                  "resume it on its own layout, without --reshard")
        spec = payload(rank)["optimizer"].get("compress", "none")
        if spec != "none":
            raise CheckpointError(f"{directory} was saved with --compress {spec}: the "
                                  "error-feedback residual is one rank's memory of its own "
                                  "gradients, no rank of another layout continues it; resume "
                                  "it on its own layout, without --reshard")
        degrees.add(place["tp"])
        for entry in place["tensors"]:
            if entry.get("scalar"):
                scalars.setdefault(entry["what"], set()).add(
                    float(_at(payload(rank), entry["path"])))
                continue
            slot = pieces.setdefault((entry["what"], entry["name"]), {})
            if place["tp_rank"] not in slot:  # replicas over dp, cp (and pp, tied) are equal
                slot[place["tp_rank"]] = _value(entry, rank, payload)
    if len(degrees) != 1:
        raise CheckpointError(f"the ranks of {directory} disagree on tp: {sorted(degrees)}")
    tp = degrees.pop()
    joined: dict[str, dict[str, torch.Tensor]] = {}
    for (what, name), slot in pieces.items():
        if sorted(slot) != list(range(tp)):
            raise CheckpointError(f"{directory}: {what} {name!r} has the tensor-parallel "
                                  f"slices {sorted(slot)}, expected 0..{tp - 1}")
        joined.setdefault(what, {})[name] = join_slices(name, [slot[t] for t in range(tp)], cfg)
    for key, found in scalars.items():
        if len(found) != 1:
            raise CheckpointError(f"optimizer state {key!r} differs between the tensors of "
                                  f"{directory}: {sorted(found)}; expected one value")
    params = joined.pop("param", None)
    if params is None:
        raise CheckpointError(f"{directory} records no parameter")
    return UniversalState(params, joined, {k: torch.tensor(v.pop()) for k, v in scalars.items()})


def _at(state, path: list):
    for key in path:
        state = state[key]
    return state


def _value(entry: dict, rank: int, payload) -> torch.Tensor:
    """The tensor ``entry`` (of :func:`engine.compose.resume.placement`) places, whole over the
    data-parallel shards: a ZeRO-3 parameter's rows joined from its ranks' shards, or a
    ZeRO-1/2 bucket joined from its ranks' shards and cut at the offset."""
    rows = entry.get("rows")
    if rows is not None:  # ZeRO-3's dim-0 shards (engine.fsdp), joined in the ranks' order
        whole = torch.cat([_at(payload(r), entry["path"]) for r in rows["ranks"]])
        if list(whole.shape) != rows["shape"]:
            raise CheckpointError(f"{entry['what']} {entry['name']!r}: its shards join into "
                                  f"{list(whole.shape)}, the placement says {rows['shape']}")
        return whole.clone()
    flat = entry.get("flat")
    if flat is None:
        return _at(payload(rank), entry["path"]).detach().clone()
    bucket = torch.cat([_at(payload(r), entry["path"]).reshape(-1) for r in flat["ranks"]])
    if bucket.numel() != flat["padded"]:
        raise CheckpointError(f"{entry['what']} {entry['name']!r}: its bucket's shards hold "
                              f"{bucket.numel()} elements, the placement says {flat['padded']}")
    numel = torch.Size(flat["shape"]).numel()
    return bucket[flat["offset"]:flat["offset"] + numel].view(flat["shape"]).clone()


def cut(values: dict[str, torch.Tensor], par: Parallel, expert_group=None
        ) -> dict[str, torch.Tensor]:
    """This rank's tensors of ``values`` (one process's names), named as ``par.model`` names
    them: a GPT holding ``values`` cut like a fresh model (module docstring, step 2)."""
    gpt = GPT(par.model.cfg, seed=0, expert_group=expert_group)
    with torch.no_grad():
        for name, p in gpt.named_parameters(remove_duplicate=False):
            value = values.get(name)
            if value is None or value.shape != p.shape:
                raise CheckpointError(
                    f"the checkpoint holds {name} as "
                    f"{'nothing' if value is None else tuple(value.shape)}; this run's GPT "
                    f"has it {tuple(p.shape)}: a checkpoint of another model")
            p.copy_(value)
    mesh, plan = par.mesh, par.plan
    if plan.tp > 1:
        apply_tensor_parallel(gpt, mesh, plan.sequence_parallel)
    if plan.ep > 1:
        apply_expert_parallel(gpt, mesh)
    if plan.pp > 1:
        apply_pipeline(gpt, mesh, plan.schedule)
    return {name: p.detach() for name, p in gpt.named_parameters(remove_duplicate=False)}


def load_universal(state: UniversalState, par: Parallel, expert_group=None) -> None:
    """Load ``state`` into this rank's part of ``par``, any layout: the parameters and every
    optimizer state cut by :func:`cut`, then packed into each ZeRO optimizer's buckets
    (:func:`engine.checkpoint.recut.load_dense`: every rank reads the same whole state, nothing is
    sent) or given to a plain AdamW as its ``state_dict``. Call on every rank."""
    buffers = sorted(name for name, _ in par.model.named_buffers())
    if buffers:
        raise CheckpointError(f"this model has buffers ({', '.join(buffers[:3])}: DeepSeek-V3's "
                              "expert bias?) that a universal state does not carry")
    params = cut(state.params, par, expert_group)
    moments = {key: cut(values, par, expert_group) for key, values in state.moments.items()}
    dense = DenseOptimizerState(moments, {key: dict.fromkeys(params, value) for key, value
                                          in state.scalars.items()})
    parts = par.optimizer.optimizers if isinstance(par.optimizer, Optimizers) else \
        (par.optimizer,)
    for part in parts:
        if isinstance(part, ZeroOptimizer):
            load_dense(par.model, part, params, dense)
        else:
            load_plain(part, par.model, params, moments, state.scalars)


@torch.no_grad()
def load_plain(optimizer: torch.optim.Optimizer, model, params: dict[str, torch.Tensor],
               moments: dict[str, dict[str, torch.Tensor]],
               scalars: dict[str, torch.Tensor]) -> None:
    """A plain optimizer over ``model``'s parameters (ZeRO-0: every rank holds them whole;
    ZeRO-3: their dim-0 shards, :mod:`engine.fsdp`, cut from the whole here): each parameter
    and its state, by name."""
    def mine(p, value: torch.Tensor) -> torch.Tensor:
        layout = getattr(p, "fsdp_layout", None)
        return value.clone() if layout is None else layout.take(value)

    name_of = {id(p): name for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.copy_(mine(p, params[name]))
    held = [p for group in optimizer.param_groups for p in group["params"]]
    found = {j: {key: mine(p, values[name_of[id(p)]]) for key, values in moments.items()}
             | {key: value.clone() for key, value in scalars.items()}
             for j, p in enumerate(held)}
    optimizer.load_state_dict({"state": found,
                               "param_groups": optimizer.state_dict()["param_groups"]})


def reshard(directory, par: Parallel) -> None:
    """Resume ``par`` from the composed checkpoint in ``directory``, saved by any layout of the
    same model: joined (:func:`universal_state`), then cut for this rank
    (:func:`load_universal`), as the two steps of the load protocol
    (:func:`engine.checkpoint.protocol.load_files`: an error on any rank, in either, is raised
    on every rank, naming it). Call on every rank."""
    from engine.moe.layer import single_rank_group

    alone = single_rank_group() if par.model.cfg.num_experts else None  # collective: first
    load_files(directory, lambda: universal_state(directory, par.model.cfg),
               lambda state: load_universal(state, par, alone))
