"""Chapter 11's bad input, each refused with a clear error naming the value, before any rank
starts where the input is known there: H < 1, fragments that do not divide the layers (or H),
a replica-group size that does not divide the world, and a rejoin with another model or
another optimizer."""

from __future__ import annotations

import pytest
import torch

from engine.ft.diloco import DiLoCo, split_fragments
from engine.ft import check_replica_groups, run_with_failure
from engine.ft.state import pack_state, unpack_state
from engine.model.mlp import MLP
from tests.helpers import descendants
from tests.test_ft import _loss, _model, _optimizer


@pytest.mark.parametrize("h", [0, -1, 2.5])
def test_h_below_one_or_not_an_int_is_named(h):
    model = MLP((8, 16, 8))
    with pytest.raises(ValueError, match=rf"sync_every \(H, the inner steps between syncs\) "
                                         rf"must be a positive int, got {h}"):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=h)


def test_fragments_that_do_not_divide_the_layers_are_named():
    with pytest.raises(ValueError, match=r"fragments = 4 must divide the model's \d+ layers"):
        split_fragments(MLP((8, 8, 8, 8)), 4)  # three Linear layers
    model = MLP((8, 8, 8, 8, 8))  # four layers, but H = 6 is not cut into 4 staggered syncs
    with pytest.raises(ValueError, match="fragments = 4 must divide sync_every = 6"):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=6, fragments=4)
    with pytest.raises(ValueError, match="fragments must be a positive int, got 0"):
        split_fragments(model, 0)


def test_a_group_size_that_does_not_divide_the_world_is_named_before_any_rank_starts():
    with pytest.raises(ValueError, match=r"group_size .* = 4 must divide the world size = 6"):
        check_replica_groups(6, 4)
    with pytest.raises(ValueError, match=r"group_size \(ranks per replica group\) must be a "
                                         r"positive int, got 0"):
        run_with_failure(_model, _optimizer, _loss, replicas=3, group_size=0)
    with pytest.raises(ValueError, match=r"replicas \(replica groups\) must be a positive int, "
                                         r"got 0"):
        run_with_failure(_model, _optimizer, _loss, replicas=0)
    with pytest.raises(ValueError, match=r"kill = \(5, 3\) must name a replica group in 0..2"):
        run_with_failure(_model, _optimizer, _loss, replicas=3, kill=(5, 3))
    assert descendants() == []  # refused before any replica process was forked


def test_a_rejoin_with_another_model_or_optimizer_is_named():
    model, other = _model(), MLP((8, 32, 8))
    live = pack_state(model, _optimizer(model), 3)
    with pytest.raises(ValueError, match=r"cannot rejoin: the live replicas train another model "
                                         r"\(here \('net.0.weight', \(32, 8\), 'torch.float32'\), "
                                         r"there \('net.0.weight', \(16, 8\)"):
        unpack_state(live, other, _optimizer(other))
    with pytest.raises(ValueError, match=r"another optimizer \(here SGD, there AdamW\)"):
        unpack_state(live, model, torch.optim.SGD(model.parameters(), lr=0.1))
    twin = _model()
    assert unpack_state(live, twin, _optimizer(twin)) == 3  # the same model and optimizer
