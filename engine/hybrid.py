"""3D parallelism: data x tensor x pipeline parallelism (plus ZeRO over the data-parallel
group) on one :class:`engine.topology.Mesh`, for the tiny GPT.

Each rank holds one pipeline stage (consecutive transformer blocks; the first stage also the
embeddings, the last the final LayerNorm and the output layer), split over its tensor-parallel
group (:mod:`engine.tp`). The pipeline runtime (:mod:`engine.pp`) moves activations between
the stages of the same (dp, tp) position. The output layer is tied to the input embedding, so
with more than one stage both the first and the last stage hold it, and their gradients are
summed over the mesh's embedding group before the step (Megatron-LM does the same). Finally
ZeRO (:class:`engine.zero.ZeroOptimizer`) averages the gradients over the data-parallel group;
at stage 1 each rank keeps 1/dp of the optimizer state (Narayanan et al., SC 2021; Rajbhandari
et al., SC 2020).

:func:`hybrid_strategy` composes these into one :class:`engine.steps.Strategy`;
:func:`train_3d` (chapter 07) and ``python -m engine train`` both run it through
:func:`engine.timed_steps.run_steps`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.comm import ops
from engine.device import rank_device
from engine.models import GPT, TinyGPT
from engine.pp import uniform_boundaries
from engine.steps import (Strategy, autocast, global_batch, parameter_count, pipeline_step,
                          trainer_schedule)
from engine.timed_steps import run_steps
from engine.topology import Mesh
from engine.tp.blocks import TensorParallelGPT, block_dense_state, gather_parameter
from engine.tp.mappings import copy_to_tp
from engine.zero import ZeroOptimizer


class GPTStage(GPT):
    """This rank's pipeline stage of a tensor-parallel :class:`TinyGPT`: the one GPT's
    :meth:`~engine.models.GPT.embed` (first stage), :meth:`~engine.models.GPT.run_blocks` and
    :meth:`output` (last stage) on the parts it holds, cut from
    :class:`engine.tp.blocks.TensorParallelGPT` (so it draws no weights of its own)."""

    def __init__(self, gpt: TinyGPT, mesh: Mesh):
        nn.Module.__init__(self)  # the parts come from ``gpt``, not from a seed
        layers = len(gpt.blocks)
        if mesh.pp > layers:
            raise ValueError(f"pp={mesh.pp} pipeline stages need at least {mesh.pp} "
                             f"transformer blocks, the model has {layers}")
        whole = TensorParallelGPT.from_dense(gpt, group=mesh.tp_group)
        starts = uniform_boundaries(layers, mesh.pp) + [layers]
        stage = mesh.coords.pp
        self.cfg, self.checkpoint, self.sp_group = gpt.cfg, False, None
        self.mesh, self.first_block = mesh, starts[stage]
        self.blocks = nn.ModuleList(whole.blocks[starts[stage]:starts[stage + 1]])
        self.first, self.last = mesh.is_first_stage, mesh.is_last_stage
        if self.first or self.last:
            self.tok = whole.tok  # input embedding on the first stage, output layer on the last
        if self.first:
            self.pos = whole.pos
        if self.last:
            self.ln_f = whole.ln_f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x)
        x = self.run_blocks(x, 0, len(self.blocks))
        return self.output(x) if self.last else x

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits: the output layer is the (vocab-parallel)
        input embedding, tied."""
        return F.linear(copy_to_tp(self.ln_f(x), self.mesh.tp_group), self.tok.weight)

    def sync_tied_embedding(self, optimizer: ZeroOptimizer) -> None:
        """Sum the embedding's gradient over the first and the last stage. At ZeRO-0/1 each
        stage holds it whole; at ZeRO-2 its bucket already reduce-scattered it over dp in
        backward, and the two stages' buckets cut it at different places: the bucket's
        averaged gradient is gathered over dp, the embedding's summed over the two stages,
        and each rank keeps its shard again."""
        group = self.mesh.embedding_group
        if group is None or not (self.first or self.last):
            return
        weight = self.tok.weight
        if weight.grad is not None:
            ops.all_reduce(weight.grad, group=group)
            return
        bucket = optimizer.launcher.bucket_of[weight]
        full = bucket.new_flat()
        ops.all_gather_into_tensor(full, bucket.shard_grad, group=self.mesh.dp_group)
        ops.all_reduce(bucket.view_of(weight, full), group=group)
        bucket.shard_grad.copy_(bucket.shard_of(full))

    def dense_state(self) -> dict[str, torch.Tensor]:
        """This stage's parameters, gathered over tp, named like the dense TinyGPT's."""
        group = self.mesh.tp_group
        state = {}
        for i, block in enumerate(self.blocks):
            state.update(block_dense_state(block, f"blocks.{self.first_block + i}.", group))
        if self.first or self.last:
            state["tok.weight"] = gather_parameter(self.tok.weight, "tok.weight", group)
        if self.first:
            state["pos.weight"] = self.pos.weight.detach().clone()
        if self.last:
            state["head.weight"] = state["tok.weight"]
            for name, p in self.ln_f.named_parameters():
                state[f"ln_f.{name}"] = p.detach().clone()
        return state


def hybrid_strategy(gpt: TinyGPT, mesh: Mesh, optimizer_cls, zero: int = 1,
                    schedule: str = "1f1b", micro_batches: int = 2,
                    device: torch.device = torch.device("cpu"), precision: str = "fp32",
                    **optimizer_kwargs) -> Strategy:
    """This rank's :class:`engine.steps.Strategy` for 3D parallelism: its
    :class:`GPTStage` of ``gpt`` (cut on the CPU, then moved to ``device``), a
    :class:`engine.zero.ZeroOptimizer` of ``optimizer_cls`` at ZeRO stage ``zero`` over the
    data-parallel group, and a step that runs ``schedule`` over ``micro_batches`` and sums the
    tied embedding's gradient before the optimizer step."""
    stage = GPTStage(gpt, mesh).to(device)
    optimizer = ZeroOptimizer(list(stage.parameters()), optimizer_cls, stage=zero,
                              group=mesh.dp_group, **optimizer_kwargs)
    plan = trainer_schedule(schedule, mesh.pp, micro_batches)
    step = pipeline_step(autocast(stage, precision), optimizer, mesh, plan,
                         before_step=lambda: stage.sync_tied_embedding(optimizer))
    return Strategy(f"3D, ZeRO-{zero}", stage, optimizer, step, parameter_count(stage), mesh,
                    device, part_of=lambda dense: GPTStage(dense, mesh))


def train_3d(rank: int, world_size: int, dp: int, tp: int, pp: int, cfg, steps: int = 3,
             micro_batches: int = 2, rows: int = 2, lr: float = 0.5, schedule: str = "1f1b",
             seed: int = 0, device: str | None = None) -> dict:
    """Train :class:`TinyGPT` (``cfg``) for ``steps`` steps of momentum SGD on a
    ``dp x tp x pp`` mesh with ZeRO-1 over dp. Every dp rank takes ``micro_batches *
    rows`` sequences of one fixed global batch. Returns this rank's stage as a dense-layout
    state, the losses (last stage), the rank's coordinates, and the bytes it sent per step
    through each kind of group. ``device``: "cuda" or "cpu"; by default
    :func:`engine.device.rank_device` ("cuda" on Gloo: CUDA tensors, see
    :mod:`engine.comm.ops`)."""
    if device is None:
        device = rank_device()
    elif device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    mesh = Mesh(dp=dp, tp=tp, pp=pp)
    strategy = hybrid_strategy(TinyGPT(cfg, seed=seed), mesh, torch.optim.SGD, 1, schedule,
                               micro_batches, device, lr=lr, momentum=0.9)
    inputs, labels = global_batch(cfg, mesh, micro_batches, rows, device, seed=seed + 1)
    steps_run = run_steps(strategy, inputs, labels, steps, warmup=0)
    return {"state": strategy.model.dense_state(), "losses": steps_run.losses,
            "coords": mesh.coords, "traffic_per_step": steps_run.traffic}


def train_reference(cfg, dp: int, steps: int = 3, micro_batches: int = 2, rows: int = 2,
                    lr: float = 0.5, seed: int = 0) -> dict:
    """The same training on one process: the mean loss over the whole global batch."""
    from engine.models import token_data

    model = TinyGPT(cfg, seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    ids, targets = token_data(dp * micro_batches * rows, cfg.seq_len, cfg.vocab, seed=seed + 1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model.loss(ids, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"state": dict(model.named_parameters(remove_duplicate=False)), "losses": losses}
