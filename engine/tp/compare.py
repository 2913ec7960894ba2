"""Tensor parallelism vs ZeRO-3, measured on the same model: what each sends per layer.

Both split a layer's parameters over ``t`` ranks. Tensor parallelism moves *activations*:
``8bsh(t-1)/t`` elements per layer per micro-batch (:func:`engine.theory.
tp_comm_elements_per_layer`), growing with the tokens in flight. ZeRO-3 moves *parameters*:
``3(t-1)/t`` times the layer's ``12h^2 + 13h`` parameters, whatever the batch. They cross at
``b*s = 3 * (12h^2 + 13h) / (8h)``, about ``4.5 h`` tokens per micro-batch.
"""

from __future__ import annotations

import torch

from engine.observe.meter import CommMeter
from engine.model.gpt import GPTConfig, TinyGPT
from engine.model.data import token_data
from engine.tp.blocks import TensorParallelGPT
from engine.zero.stage3 import ZeroDataParallel


def _sent(model, loss_of, x, y) -> int:
    with CommMeter() as meter:
        loss_of(model, x, y).backward()
    return meter.bytes_sent


def _dense_loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def layer_traffic(rank: int, world_size: int, batch: int, seq_len: int, hidden: int = 32,
                  heads: int = 4, vocab: int = 64) -> dict[str, float]:
    """fp32 elements this rank sends per transformer layer in one forward + backward, under
    tensor parallelism and under ZeRO-3 (units = blocks), from runs with 1 and 3 layers."""
    sent = {}
    for layers in (1, 3):
        cfg = GPTConfig(vocab=vocab, seq_len=seq_len, layers=layers, heads=heads, hidden=hidden)
        x, y = token_data(batch, seq_len, vocab, seed=rank)
        tp = TensorParallelGPT.from_dense(TinyGPT(cfg, seed=0))
        sent["tp", layers] = _sent(tp, lambda m, a, b: m.loss(a, b), x, y)
        gpt = TinyGPT(cfg, seed=0)
        zero3 = ZeroDataParallel(gpt, torch.optim.SGD, units=gpt.blocks, lr=0.0)
        sent["zero3", layers] = _sent(zero3, _dense_loss, x, y)
    return {kind: (sent[kind, 3] - sent[kind, 1]) / 2 / 4 for kind in ("tp", "zero3")}


def crossover_tokens(hidden: int) -> float:
    """Tokens per micro-batch (b*s) at which TP and ZeRO-3 send the same per layer."""
    return 3 * (12 * hidden * hidden + 13 * hidden) / (8 * hidden)
