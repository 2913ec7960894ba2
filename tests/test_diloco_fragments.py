"""Streaming DiLoCo's fragments given as modules (engine.ft.diloco.module_fragments, torchft's
``model_fragments``), and the chapter experiment's cut of the GPT into whole blocks: every
trainable parameter in exactly one fragment, a tied weight in its first, bad parts named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.ft.diloco import DiLoCo, module_fragments
from engine.labs.diloco import CONFIG, block_fragments
from engine.model.data import markov_tokens
from engine.model.mlp import MLP
from engine.model.gpt import TinyGPT


def test_the_gpt_cut_into_blocks_holds_every_parameter_once():
    model = TinyGPT(CONFIG)
    split = module_fragments(model, block_fragments(model, 4))
    assert len(split) == 4
    ids = [id(p) for part in split for p in part]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))  # the head is tied
    def holds(part, param):
        return any(p is param for p in part)

    assert holds(split[0], model.tok.weight) and holds(split[3], model.ln_f.weight)
    for i, block in enumerate(model.blocks):  # one block per fragment, in order
        assert all(holds(split[i], p) for p in block.parameters())


def test_bad_module_fragments_are_named():
    model = MLP((8, 8, 8, 8))
    first, second, third = (m for m in model.modules() if isinstance(m, nn.Linear))
    with pytest.raises(ValueError, match=r"leave 2 of the model's parameters out \(first: "
                                         r"net.4.weight\)"):
        module_fragments(model, [first, second])
    with pytest.raises(ValueError, match=r"fragment 1 \(Linear\) holds parameters that are not "
                                         r"the model's"):
        module_fragments(model, [model, nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"fragment 1 \(Linear\) has no trainable parameter of "
                                         r"its own"):
        module_fragments(model, [model, first])
    with pytest.raises(ValueError, match="fragments = 3 must divide sync_every = 4"):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4,
               fragments=[first, second, third])


def test_the_markov_data_is_learnable_and_seeded():
    idx, targets = markov_tokens(4, 16, 64, seed=5)
    again, _ = markov_tokens(4, 16, 64, seed=5)
    assert torch.equal(idx, again) and torch.equal(idx[:, 1:], targets[:, :-1])
    # each token's successors concentrate on a few: far fewer distinct bigrams than random
    many, nxt = markov_tokens(256, 16, 64, seed=6)
    pairs = {(a, b) for a, b in zip(many.reshape(-1).tolist(), nxt.reshape(-1).tolist())}
    assert len(pairs) < 0.3 * 64 * 64
