"""Tensor parallelism vs ZeRO-3, measured on the same model: what each sends per layer (chapter 05).

Both split a layer's parameters over ``t`` ranks. Tensor parallelism moves *activations*:
``8bsh(t-1)/t`` elements per layer per micro-batch (:func:`engine.theory.
tp_comm_elements_per_layer`), growing with the tokens in flight. ZeRO-3 moves *parameters*:
``3(t-1)/t`` times the layer's ``12h^2 + 13h`` parameters, whatever the batch. They cross at
:func:`engine.theory.tp_zero3_crossover_tokens` tokens per micro-batch, about ``4.5 h``.

Both sides are the one GPT (:class:`engine.compose.model.GPT`) parallelised by
:func:`engine.compose.parallelize.parallelize`: ``Plan(tp=t)`` and ``Plan(dp=t, zero=3)`` (a
unit per block, as FSDP wraps them). Every byte is counted by the meter.
"""

from __future__ import annotations

import torch

from engine.compose.loss import token_losses
from engine.compose.model import GPT, ModelConfig
from engine.compose.parallelize import parallelize
from engine.compose.plan import Plan
from engine.model.data import token_data
from engine.observe.meter import CommMeter

__all__ = ["layer_traffic"]


def layer_traffic(rank: int, world_size: int, batch: int, seq_len: int, hidden: int = 32,
                  heads: int = 4, vocab: int = 64) -> dict[str, float]:
    """fp32 elements this rank sends per transformer layer in one forward + backward, under
    tensor parallelism (every rank the same ``batch`` sequences) and under ZeRO-3 (each rank
    its own), from runs with 1 and 3 layers (their difference, halved)."""
    plans = {"tp": Plan(tp=world_size), "zero3": Plan(dp=world_size, zero=3)}
    meshes = {kind: plan.mesh() for kind, plan in plans.items()}  # collective: built once
    sent = {}
    for layers in (1, 3):
        cfg = ModelConfig(vocab=vocab, seq_len=seq_len, layers=layers, heads=heads,
                          hidden=hidden)
        for kind, plan in plans.items():
            par = parallelize(GPT(cfg, seed=0), meshes[kind], plan, torch.optim.SGD, lr=0.0)
            x, y = token_data(batch, seq_len, vocab, seed=par.mesh.coords.dp)
            with CommMeter() as meter:
                token_losses(par.module(x), y, par.tp_group).mean().backward()
            sent[kind, layers] = meter.bytes_sent
    return {kind: (sent[kind, 3] - sent[kind, 1]) / 2 / 4 for kind in plans}
