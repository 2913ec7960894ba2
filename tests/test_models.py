"""engine.model.gpt: deterministic weights and data, the shapes a chapter relies on."""

from __future__ import annotations

import pytest
import torch

from engine.model.mlp import MLP
from engine.model.gpt import GPTConfig, TinyGPT
from engine.model.data import regression_data, shard, token_data


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def test_same_seed_same_weights_and_the_callers_rng_is_untouched():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = MLP(seed=7), MLP(seed=7), MLP(seed=8)
    assert torch.equal(torch.rand(1), before)  # building models did not consume our RNG
    assert all(torch.equal(x, y) for x, y in zip(_weights(a), _weights(b)))
    assert not all(torch.equal(x, y) for x, y in zip(_weights(a), _weights(c)))


def test_tiny_gpt_shapes_loss_and_tied_head():
    cfg = GPTConfig(vocab=40, seq_len=12, layers=2, heads=4, hidden=32)
    model = TinyGPT(cfg, seed=1)
    idx, targets = token_data(batch=3, seq_len=12, vocab=40, seed=0)
    assert model(idx).shape == (3, 12, 40)
    loss = model.loss(idx, targets)
    assert abs(loss.item() - torch.log(torch.tensor(40.0)).item()) < 0.5  # near uniform at init
    loss.backward()
    assert model.head.weight is model.tok.weight and model.tok.weight.grad is not None


def test_tiny_gpt_is_causal():
    model = TinyGPT(GPTConfig(), seed=0)
    idx, _ = token_data(1, 16, 64, seed=3)
    changed = idx.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 64
    a, b = model(idx), model(changed)
    assert torch.equal(a[:, :10], b[:, :10])  # positions before 10 cannot see position 10
    assert not torch.equal(a[:, 10:], b[:, 10:])


def test_data_is_deterministic_and_shards_split_the_batch():
    x1, y1 = regression_data(8, 4, 2, seed=5)
    x2, y2 = regression_data(8, 4, 2, seed=5)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(torch.cat([shard(x1, r, 4) for r in range(4)]), x1)
    with pytest.raises(ValueError, match="global batch of 8 does not split evenly over 3 ranks"):
        shard(x1, 0, 3)


@pytest.mark.parametrize("bad, message", [
    (dict(hidden=30, heads=4), "hidden=30 must be divisible by heads=4"),
    (dict(layers=0), "GPTConfig.layers must be a positive int, got 0"),
])
def test_bad_config_is_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**bad)


def test_too_long_a_sequence_and_bad_sizes_are_clear_errors():
    with pytest.raises(ValueError, match="sequence length 20 exceeds GPTConfig.seq_len=16"):
        TinyGPT()(torch.zeros(1, 20, dtype=torch.long))
    with pytest.raises(ValueError, match="sizes must list >= 2 positive layer widths"):
        MLP((16,))


def test_activation_checkpointing_keeps_less_and_gives_the_same_gradients():
    from engine.observe.memory import ActivationTracker
    from engine.model.gpt import GPTConfig, TinyGPT
    from engine.model.data import token_data

    cfg = GPTConfig(vocab=64, seq_len=32, layers=4, heads=4, hidden=64)
    x, y = token_data(8, 32, 64, seed=0)
    kept, grads = {}, {}
    for checkpoint in (False, True):
        model = TinyGPT(cfg, seed=0, checkpoint=checkpoint)
        with ActivationTracker(exclude=model.parameters()) as acts:
            loss = model.loss(x, y)
        loss.backward()
        kept[checkpoint] = acts.bytes
        grads[checkpoint] = [p.grad for p in model.parameters()]
    # only each block's input survives the forward: a fraction of what four blocks keep
    assert kept[True] < kept[False] / 3
    for a, b in zip(grads[False], grads[True], strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_causal_attention_is_eq_1_of_attention_is_all_you_need_with_the_causal_mask():
    import torch.nn.functional as F

    from engine.model.attention import causal_attention, causal_mask

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 16, generator=g) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(causal_attention(q, k, v), expected, atol=1e-6)
    scores = causal_mask(torch.zeros(4, 4))
    assert torch.equal(scores.isinf(), torch.ones(4, 4, dtype=torch.bool).triu(1))
    later = v.clone()
    later[..., 5:, :] += 1.0  # keys and values after query 4 cannot reach it
    assert torch.equal(causal_attention(q, k, later)[..., :5, :],
                       causal_attention(q, k, v)[..., :5, :])


def test_context_parallel_diagonal_block_is_the_same_causal_attention():
    import math

    from engine.model.attention import causal_attention
    from engine.cp.blocks import DIAGONAL, block_forward

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=g) for _ in range(3))
    out, _ = block_forward(q, k, v, 1 / math.sqrt(16), DIAGONAL)
    assert torch.allclose(out, causal_attention(q, k, v), atol=1e-6)


def test_gpt2_init_draws_weights_at_std_0_02_and_zeroes_biases():
    from torch import nn

    from engine.model.gpt import gpt2_init
    from engine.model.seed import seeded

    with seeded(0):
        layer, embedding = nn.Linear(256, 256), nn.Embedding(256, 64)
    layer.apply(gpt2_init)
    embedding.apply(gpt2_init)
    assert torch.count_nonzero(layer.bias) == 0
    for weight in (layer.weight, embedding.weight):
        assert abs(weight.std().item() - 0.02) < 0.002


def test_grouped_query_attention_is_multi_head_attention_with_each_kv_head_shared():
    """GQA (heads 4, KV heads 2: query heads 0-1 read KV head 0, 2-3 KV head 1) gives the bits
    of multi-head attention whose K and V rows of each query head are its KV head's."""
    gqa = TinyGPT(GPTConfig(heads=4, kv_heads=2, hidden=32), seed=2)
    mha = TinyGPT(GPTConfig(heads=4, hidden=32), seed=2)
    assert gqa.blocks[0].attn.qkv.out_features == (4 + 2 * 2) * 8
    state = dict(gqa.state_dict())
    for i in range(2):
        for kind in ("weight", "bias"):
            name = f"blocks.{i}.attn.qkv.{kind}"
            q, k, v = state[name].split([32, 16, 16])
            state[name] = torch.cat([q] + [t.view(2, 8, *t.shape[1:]).repeat_interleave(
                2, dim=0).reshape(32, *t.shape[1:]) for t in (k, v)])
    mha.load_state_dict(state)
    idx = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(gqa(idx), mha(idx))


def test_the_one_gpt_untied_without_qkv_bias_and_a_wider_mlp():
    model = TinyGPT(GPTConfig(tied=False, qkv_bias=False, ffn_hidden=24), seed=0)
    assert model.head.weight is not model.tok.weight
    assert model.blocks[0].attn.qkv.bias is None and model.blocks[0].fc.out_features == 24
    assert "head.weight" in dict(model.named_parameters())  # its own parameter, untied
    assert model(torch.zeros(1, 16, dtype=torch.long)).shape == (1, 16, 64)


@pytest.mark.parametrize("bad, message", [
    (dict(heads=4, kv_heads=3), "GPTConfig.kv_heads=3 must divide heads=4"),
    (dict(ffn_hidden=-1), "GPTConfig.ffn_hidden"),
])
def test_bad_architecture_choices_are_clear_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**bad)


def test_feed_forward_layers_are_injected_under_the_next_seed_and_replace_the_mlp():
    from torch import nn

    from engine.model.gpt import GPT
    from engine.model.seed import seeded

    def linears(layers):
        return [nn.Linear(32, 32) for _ in range(layers)]

    model = GPT(GPTConfig(), seed=4, feed_forward=linears)
    with seeded(5):
        expected = linears(2)
    for block, layer in zip(model.blocks, expected):
        assert torch.equal(block.moe.weight, layer.weight)
        assert not hasattr(block, "fc") and not hasattr(block, "out")
    dense = GPT(GPTConfig(), seed=4)  # everything else: the dense model's bits
    for name, value in dense.state_dict().items():
        if ".fc." not in name and ".out." not in name:
            assert torch.equal(value, model.state_dict()[name]), name
    idx, targets = token_data(2, 16, 64, seed=0)
    assert torch.equal(model.loss(idx, targets), torch.nn.functional.cross_entropy(
        model(idx).flatten(0, 1), targets.flatten()))  # no router losses from plain layers
    with pytest.raises(ValueError, match="feed_forward gave 1 layers; expected one per block, 2"):
        GPT(GPTConfig(), feed_forward=lambda layers: linears(1))


def test_sequence_parallel_positions_need_the_tensor_parallel_layer_above():
    model = TinyGPT()
    model.sp_group = "the tp group"
    with pytest.raises(NotImplementedError, match="use engine.compose.model.GPT"):
        model(torch.zeros(1, 16, dtype=torch.long))
