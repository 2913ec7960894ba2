"""3D parallelism: data x tensor x pipeline parallelism (plus ZeRO-1 over the data-parallel
group) on one :class:`engine.topology.Mesh`, for the tiny GPT.

Each rank holds one pipeline stage (consecutive transformer blocks; the first stage also the
embeddings, the last the final LayerNorm and the output layer), split over its tensor-parallel
group (:mod:`engine.tp`). The pipeline runtime (:mod:`engine.pp`) moves activations between
the stages of the same (dp, tp) position. The output layer is tied to the input embedding, so
with more than one stage both the first and the last stage hold it, and their gradients are
summed over the mesh's embedding group before the step (Megatron-LM does the same). Finally
ZeRO-1 (:class:`engine.zero.ZeroOptimizer`) averages the gradients over the data-parallel
group and keeps 1/dp of the optimizer state per rank (Narayanan et al., SC 2021; Rajbhandari
et al., SC 2020).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.comm import CommMeter, ops
from engine.models import TinyGPT
from engine.pp import gpipe, one_f_one_b, run_pipeline, uniform_boundaries
from engine.topology import Mesh
from engine.tp.blocks import TensorParallelGPT, _gather_dim, block_dense_state
from engine.tp.layers import vocab_parallel_cross_entropy
from engine.tp.mappings import copy_to_tp
from engine.zero import ZeroOptimizer


class GPTStage(nn.Module):
    """This rank's pipeline stage of a tensor-parallel :class:`TinyGPT`."""

    def __init__(self, gpt: TinyGPT, mesh: Mesh):
        super().__init__()
        layers = len(gpt.blocks)
        if mesh.pp > layers:
            raise ValueError(f"pp={mesh.pp} pipeline stages need at least {mesh.pp} "
                             f"transformer blocks, the model has {layers}")
        whole = TensorParallelGPT.from_dense(gpt, group=mesh.tp_group)
        starts = uniform_boundaries(layers, mesh.pp) + [layers]
        stage = mesh.coords.pp
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
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = F.linear(copy_to_tp(self.ln_f(x), self.mesh.tp_group), self.tok.weight)
        return x

    def sync_tied_embedding(self) -> None:
        """Sum the embedding's gradient over the first and the last stage."""
        if self.mesh.embedding_group is not None and (self.first or self.last):
            ops.all_reduce(self.tok.weight.grad, group=self.mesh.embedding_group)

    def dense_state(self) -> dict[str, torch.Tensor]:
        """This stage's parameters, gathered over tp, named like the dense TinyGPT's."""
        group = self.mesh.tp_group
        state = {}
        for i, block in enumerate(self.blocks):
            state.update(block_dense_state(block, f"blocks.{self.first_block + i}.", group))
        if self.first or self.last:
            state["tok.weight"] = _gather_dim(self.tok.weight.detach(), 0, group)
        if self.first:
            state["pos.weight"] = self.pos.weight.detach().clone()
        if self.last:
            state["head.weight"] = state["tok.weight"]
            for name, p in self.ln_f.named_parameters():
                state[f"ln_f.{name}"] = p.detach().clone()
        return state


def train_3d(rank: int, world_size: int, dp: int, tp: int, pp: int, cfg, steps: int = 3,
             micro_batches: int = 2, rows: int = 2, lr: float = 0.5, schedule: str = "1f1b",
             seed: int = 0, device: str | None = None) -> dict:
    """Train :class:`TinyGPT` (``cfg``) for ``steps`` steps of momentum SGD on a
    ``dp x tp x pp`` mesh with ZeRO-1 over dp. Every dp rank takes ``micro_batches *
    rows`` sequences of one fixed global batch. Returns this rank's stage as a dense-layout
    state, the losses (last stage), the rank's coordinates, and the bytes it sent per step
    through each kind of group. ``device``: "cuda" or "cpu"; by default this rank's GPU under
    NCCL, else the CPU ("cuda" on Gloo: CUDA tensors, see :mod:`engine.comm.ops`)."""
    from engine.models import token_data

    import torch.distributed as dist

    if device is None:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" \
        else torch.device(device)
    mesh = Mesh(dp=dp, tp=tp, pp=pp)
    stage = GPTStage(TinyGPT(cfg, seed=seed).to(device), mesh)
    optimizer = ZeroOptimizer(list(stage.parameters()), torch.optim.SGD, stage=1,
                              group=mesh.dp_group, lr=lr, momentum=0.9)
    ids, targets = token_data(dp * micro_batches * rows, cfg.seq_len, cfg.vocab, seed=seed + 1)
    ids, targets = ids.to(device), targets.to(device)
    mine = slice(mesh.coords.dp * micro_batches * rows, (mesh.coords.dp + 1) * micro_batches
                 * rows)
    inputs, labels = list(ids[mine].chunk(micro_batches)), list(targets[mine].chunk(micro_batches))
    plan = (one_f_one_b if schedule == "1f1b" else gpipe)(pp, micro_batches)

    def loss_fn(logits, y):
        return vocab_parallel_cross_entropy(logits, y, mesh.tp_group).mean()

    losses = []
    groups = {"tp": mesh.tp_group, "dp": mesh.dp_group, "pp": mesh.pp_group,
              "embedding": mesh.embedding_group}
    # collectives by their group (the pp and embedding groups can hold the same two ranks:
    # point-to-point traffic is the pipeline's, collectives there are the embedding's)
    kinds = {ops.group_ranks(g): kind for kind, g in groups.items()
             if g is not None and kind != "pp"}
    traffic = dict.fromkeys(groups, 0)
    for _ in range(steps):
        optimizer.zero_grad()
        with CommMeter() as meter:
            run = run_pipeline([stage], plan, inputs, labels, loss_fn, stage=mesh.coords.pp,
                               group=mesh.pp_group)
            stage.sync_tied_embedding()
            optimizer.step()
        for event in meter.events:  # bytes this rank sent, by the group they went through
            point_to_point = event.op in ("send", "recv", "isend", "irecv")
            kind = "pp" if point_to_point else kinds.get(event.group, "other")
            traffic[kind] = traffic.get(kind, 0) + event.bytes_sent
        losses.append(run.loss)
    return {"state": stage.dense_state(), "losses": losses, "coords": mesh.coords,
            "traffic_per_step": {k: v / steps for k, v in traffic.items()}}


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
