"""The presets ``engine train --model`` names, their published sizes, and the Llama pieces
(RMSNorm, rotary positions, SwiGLU) against independent formulations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.gpt import GPT, GPTConfig
from engine.model.presets import MODELS
from engine.model.rmsnorm import RMSNorm
from engine.model.rope import rotate

PUBLISHED = {  # parameters, the tied embedding counted once
    "gpt2-124m": 124_439_808,  # GPT-2 small, the 124M checkpoint
    "llama3-1b": 1_235_814_400,  # Llama 3.2 1B
    "llama3-8b": 8_030_261_248,  # Llama 3 8B
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_presets_have_their_published_parameter_counts_on_the_meta_device(name):
    with torch.device("meta"):
        model = GPT(MODELS[name])
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]
    assert all(p.is_meta for p in model.parameters())  # nothing allocated


def test_llama_tiny_is_the_llama_architecture():
    model = GPT(MODELS["llama-tiny"])
    names = {n for n, _ in model.named_parameters()}
    assert "pos.weight" not in names and "head.weight" in names  # rotary; untied
    assert not any(n.endswith("bias") for n in names)
    assert {"blocks.0.gate_up.weight", "blocks.0.out.weight"} <= names  # [gate | up] fused
    assert model.blocks[0].gate_up.out_features == 2 * 96
    assert isinstance(model.ln_f, RMSNorm)
    assert model.blocks[0].attn.kv_heads == 2 < model.blocks[0].attn.heads
    ids = torch.randint(0, 64, (3, 16))
    loss = model.loss(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert abs(loss.item() - torch.log(torch.tensor(64.0)).item()) < 0.1  # about ln(vocab)
    assert all(p.grad is not None for p in model.parameters())


def _rotate_as_complex(x, positions, theta):
    """Meta's reference formulation: each adjacent pair a complex number, times e^{i m w}."""
    d = x.shape[-1]
    w = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    turn = torch.polar(torch.ones(len(positions), d // 2, dtype=torch.float64),
                       positions.double()[:, None] * w[None, :])
    pairs = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * turn).flatten(-2)


def test_rotary_positions_are_reference_llamas_and_relative():
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    at = torch.tensor([0, 1, 2, 7, 11])
    # fp32 angles and rotations against float64: rounding of fp32 alone
    assert torch.allclose(rotate(q, at, 500_000.0), _rotate_as_complex(q, at, 500_000.0).float(),
                          atol=1e-5)
    # the scores see m - n only: every position shifted by 40 gives the same q . k
    scores = rotate(q, at, 10_000.0) @ rotate(k, at, 10_000.0).transpose(-2, -1)
    shifted = rotate(q, at + 40, 10_000.0) @ rotate(k, at + 40, 10_000.0).transpose(-2, -1)
    assert torch.allclose(scores, shifted, atol=1e-4)
    assert not torch.allclose(scores, q @ k.transpose(-2, -1), atol=1e-2)  # it does rotate


def test_rmsnorm_is_pytorchs():
    x, norm = torch.randn(4, 6, 32), RMSNorm(32)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    expected = F.rms_norm(x, (32,), norm.weight, eps=1e-5)
    assert torch.allclose(norm(x), expected, atol=1e-6)  # fp32, the mean in another order


@pytest.mark.parametrize("field, value, words", [
    ("norm", "batchnorm", "norm"), ("mlp", "relu", "mlp"), ("positions", "alibi", "positions"),
    ("rope_theta", 0.0, "rope_theta"), ("rope_theta", -1.0, "rope_theta")])
def test_bad_architecture_choices_are_refused_naming_the_value(field, value, words):
    with pytest.raises(ValueError, match=words):
        GPTConfig(**{field: value})


def test_rotary_positions_need_an_even_head_dim():
    with pytest.raises(ValueError, match="head_dim"):
        GPTConfig(hidden=30, heads=2, positions="rope")


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_the_fast_attention_trains_as_the_written_one(name):
    """The same model and batch through the fused kernel and through the written-out
    equation: the sums in another order, so not bit-equal; fp32 rounding bounds it."""
    from dataclasses import replace

    ids = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(3))
    grads = {}
    for kernel in ("written", "fast"):
        model = GPT(replace(MODELS[name], attention=kernel), seed=1)
        loss = model.loss(ids[:, :-1], ids[:, 1:])
        loss.backward()
        grads[kernel] = (loss.detach(), [p.grad for p in model.parameters()])
    (written, gw), (fast, gf) = grads["written"], grads["fast"]
    assert abs(written - fast).item() <= 1e-6
    assert max((a - b).abs().max().item() for a, b in zip(gw, gf)) <= 1e-6


def test_a_large_vocabulary_draws_its_synthetic_chain_from_a_sparse_table():
    """GPT-2's 50,257 tokens would make the dense transition table 10 GB: each token's next
    is drawn among its own SUCCESSORS instead, as deterministically."""
    from engine.model.data import SUCCESSORS, global_batch, successor_table

    batch = global_batch(3, 4, 64, 50_257)
    assert torch.equal(batch.ids, global_batch(3, 4, 64, 50_257).ids)
    ids, probs = successor_table(50_257, 1)
    assert ids.shape == probs.shape == (50_257, SUCCESSORS)
    stream = torch.cat([batch.ids, batch.targets[:, -1:]], dim=1)
    for row in stream:  # every step of the walk is to one of the token's successors
        assert all(b in ids[a] for a, b in zip(row[:-1].tolist(), row[1:].tolist()))
    assert int(batch.ids.max()) >= 1024  # beyond the dense table's reach


def _trained(args: list[str], capsys) -> list[float]:
    import re

    from engine.__main__ import main

    assert main(["train", "--model", "llama-tiny", "--steps", "3", *args]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith("  loss per step ("))
    return [float(x) for x in re.findall(r"\d+\.\d+", line.split(":", 1)[1])]


def test_compiled_blocks_train_as_the_eager_ones(capsys):
    """--compile: each block's forward through torch.compile (its kernels fuse operations,
    so the sums round differently: within 1e-6 of eager's losses), ZeRO-3's hooks around the
    compiled blocks (one layout: a first compile takes about 30 s on a CPU)."""
    layout = ["--world-size", "2", "--dp", "2", "--zero", "3"]
    eager = _trained(layout, capsys)
    compiled = _trained([*layout, "--compile"], capsys)
    assert max(abs(a - b) for a, b in zip(eager, compiled)) <= 1e-6


def test_compile_with_collectives_inside_a_block_is_refused(capsys):
    from engine.__main__ import main

    assert main(["train", "--model", "llama-tiny", "--world-size", "2", "--tp", "2",
                 "--compile"]) == 2
    assert "--compile with --tp 2" in capsys.readouterr().err
