"""The engine's ZeRO-3 beside PyTorch's FSDP2 (fully_shard on a CPU DeviceMesh, Gloo): the same
losses and parameters, the same bytes held per rank, the same collectives; and the engine's
Mesh beside init_device_mesh: the same rank sets."""

from __future__ import annotations

import pytest
import torch

from engine import theory
from engine.labs.fsdp2 import mesh_rank_sets, side_by_side
from engine.model.gpt import GPTConfig
from tests.helpers import run_ranks

CFG = GPTConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32)
PSI = 28_032  # the tiny GPT's parameters (the tied embedding once)
ROOT = 64 * 32 + 16 * 32 + 2 * 32  # tok (= head), pos, ln_f: gathered once, kept through backward
STEPS, LR = 3, 1e-2


def _key_bias(name: str) -> slice | None:
    """The key third of a qkv bias: see test_the_same_training_at_4_ranks."""
    return slice(CFG.hidden, 2 * CFG.hidden) if name.endswith("attn.qkv.bias") else None


def test_the_same_training_bit_for_bit_at_2_ranks():
    for rank in run_ranks(side_by_side, 2, CFG, STEPS, LR):
        ours, torchs = rank["zero3"], rank["torch"]
        assert ours.losses == torchs.losses
        assert ours.params.keys() == torchs.params.keys()
        for name in ours.params:
            assert torch.equal(ours.params[name], torchs.params[name]), name


def test_the_same_training_at_4_ranks_the_same_bytes_held_and_the_same_collectives():
    n = 4
    for rank in run_ranks(side_by_side, n, CFG, STEPS, LR):
        ours, torchs = rank["zero3"], rank["torch"]
        # the units' flat buckets and FSDP2's per-parameter shards put an element at other
        # places of the reduce-scatter's ring, so at 4 ranks sums round differently
        assert ours.losses == pytest.approx(torchs.losses, rel=1e-6)
        for name, value in ours.params.items():
            other = torchs.params[name]
            keys = _key_bias(name)
            if keys is not None:
                # the key bias has no gradient in exact arithmetic (softmax ignores a shift
                # shared by all keys); AdamW scales its rounding noise up to steps of up to
                # lr, in the sign the noise happens to have, so only that bound holds
                assert (value[keys] - other[keys]).abs().max() <= STEPS * LR
                value, other = value.clone(), other.clone()
                value[keys] = other[keys] = 0
            torch.testing.assert_close(value, other, rtol=0, atol=1e-6, msg=name)
        # bytes held after a step: 4 B of parameters, 4 of gradients and 8 of AdamW's moments
        # per parameter, each / N (Rajbhandari et al., SC 2020, section 5.1; no padding here);
        # the optimizer's step counters besides: one per unit, one per parameter in FSDP2
        zero3 = theory.zero_model_state_bytes(PSI, n, 3, k=8, param_bytes=4, grad_bytes=4)
        for held, counters in ((ours.held, 3), (torchs.held, 28)):
            assert held.params == zero3["params"] and held.grads == zero3["grads"]
            assert held.optimizer == zero3["optimizer"] + 4 * counters
        # one step: the root gathered once, each block gathered for forward and for backward,
        # one reduce-scatter per unit: the same on both sides, and the same bytes (counted on
        # the wire for the engine, PyTorch's by the ring formula from the sizes it passed)
        assert ours.calls == torchs.calls == {"all_gather": 1 + 2 * CFG.layers,
                                              "reduce_scatter": 1 + CFG.layers}
        assert ours.bytes_sent == torchs.bytes_sent == \
            round((theory.zero_comm_elements(PSI, n, 3) - (n - 1) / n * ROOT) * 4)


def test_the_mesh_builds_the_rank_sets_init_device_mesh_builds():
    for rank, groups in enumerate(run_ranks(mesh_rank_sets, 8, 2, 2, 2)):
        for name, (ours, torchs) in groups.items():
            assert ours == torchs, (rank, name)
            assert rank in ours
