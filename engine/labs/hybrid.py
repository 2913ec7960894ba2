"""3D parallelism: data x tensor x pipeline parallelism (plus ZeRO-1 over the data-parallel
group) of the tiny GPT, on the composed engine: one :class:`engine.topology.Mesh`, the one GPT
(:class:`engine.compose.model.GPT`) parallelised by :func:`engine.compose.parallelize.
parallelize`, the one step of :func:`engine.compose.loop.train_step`.

Each rank holds one pipeline stage (consecutive transformer blocks; the first stage also the
embeddings, the last the final norm and the output layer), split over its tensor-parallel
group (:mod:`engine.tp`). The pipeline schedule (:mod:`engine.pp`) moves activations between
the stages of the same (dp, tp) position. The output layer is tied to the input embedding, so
with more than one stage both the first and the last stage hold it, and their gradients are
summed over the mesh's embedding group before the step (Megatron-LM does the same). Finally
ZeRO-1 averages the gradients over the data-parallel group and each rank keeps 1/dp of the
optimizer state (Narayanan et al., SC 2021; Rajbhandari et al., SC 2020).

:func:`train_3d` (chapter 07) runs it for a few steps of momentum SGD and returns what a
learner compares with one process (:func:`train_reference`); ``python -m engine train`` runs
the same composed engine for every layout (:mod:`engine.train.composed`).
"""

from __future__ import annotations

import torch

from engine.observe.meter import CommMeter
from engine.model.data import global_batch
from engine.compose.loop import train_step
from engine.compose.loss import masked_sum
from engine.compose.model import GPT, ModelConfig
from engine.compose.parallelize import parallelize
from engine.compose.plan import Plan
from engine.compose.state import dense_state
from engine.compose.traffic import bytes_by_kind
from engine.launch.device import rank_device
from engine.model.gpt import GPTConfig

__all__ = ["train_3d", "train_reference", "model_of"]
KINDS = ("dp", "tp", "pp", "embedding")  # what train_3d's traffic always reports


def model_of(cfg: GPTConfig) -> ModelConfig:
    """The composed GPT of ``cfg``'s sizes: tied embeddings, no bias on q, k, v (as
    ``engine train`` builds it: :func:`engine.train.composed.model_config`)."""
    return ModelConfig.from_gpt(cfg, qkv_bias=False)


def train_3d(rank: int, world_size: int, dp: int, tp: int, pp: int, cfg, steps: int = 3,
             micro_batches: int = 2, rows: int = 2, lr: float = 0.5, schedule: str = "1f1b",
             seed: int = 0, device: str | None = None) -> dict:
    """Train the GPT of ``cfg`` (:func:`model_of`) for ``steps`` steps of momentum SGD on a
    ``dp x tp x pp`` mesh with ZeRO-1 over dp, every step on one fixed global batch
    (:func:`engine.model.data.global_batch` of step 0, ``dp * micro_batches * rows``
    sequences), so the loss goes down as the model learns it.
    Returns this rank's parameters, whole over tp and named as one process names them
    (``state``), the global loss of every step (``losses``), the rank's coordinates, and the
    bytes it sent in the first step through each kind of group
    (:func:`engine.compose.traffic.bytes_by_kind`, the tied embedding's sum apart).
    ``device``: "cuda" or "cpu"; by default :func:`engine.launch.device.rank_device` ("cuda" on
    Gloo: CUDA tensors, see :mod:`engine.comm.ops`)."""
    if device is None:
        device = rank_device()
    elif device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if pp > cfg.layers:
        raise ValueError(f"pp={pp} pipeline stages need at least {pp} transformer blocks, the "
                         f"model has {cfg.layers}")
    model_cfg = model_of(cfg)
    plan = Plan(dp=dp, tp=tp, pp=pp, zero=1, schedule=schedule, micro_batches=micro_batches)
    mesh = plan.mesh()
    global_rows = dp * micro_batches * rows
    plan.check(model_cfg, global_rows)
    par = parallelize(GPT(model_cfg, seed=seed).to(device), mesh, plan, torch.optim.SGD,
                      lr=lr, momentum=0.9)
    losses, traffic = [], dict.fromkeys(KINDS, 0)
    batch = global_batch(0, global_rows, cfg.seq_len, cfg.vocab, seed + 1)  # every step's
    for k in range(steps):
        if k == 0:
            with CommMeter(count="wire") as meter:
                losses.append(train_step(par, batch, k))
            by_kind = bytes_by_kind(meter.events, mesh, moe=False, embedding=True)
            traffic = {kind: by_kind[kind] for kind in KINDS}
        else:
            losses.append(train_step(par, batch, k))
    return {"state": dense_state(par), "losses": losses, "coords": mesh.coords,
            "traffic_per_step": traffic}


def train_reference(cfg, dp: int, steps: int = 3, micro_batches: int = 2, rows: int = 2,
                    lr: float = 0.5, seed: int = 0) -> dict:
    """The same training on one process: each step the mean loss over every token of the
    same fixed global batch."""
    model = GPT(model_of(cfg), seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    batch = global_batch(0, dp * micro_batches * rows, cfg.seq_len, cfg.vocab, seed + 1)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = masked_sum(model(batch.ids), batch.targets, batch.mask) / batch.tokens
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"state": dict(model.named_parameters(remove_duplicate=False)), "losses": losses}
