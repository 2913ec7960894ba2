"""Per-step fault tolerance (engine.ft): three replicas (one rank each), one SIGKILLed mid-step;
the survivors finish the next step without a restart, it rejoins with the survivors' state
bit for bit, and the run equals the algorithm recomputed in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.ft import reference_run, run_with_failure
from engine.models import MLP, regression_data
from tests.helpers import descendants

SIZES = (8, 16, 8)


def _model():
    return MLP(SIZES, seed=7)


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _loss(model, step, replica):
    x, y = regression_data(8, 8, 8, seed=1000 * step + replica)
    return nn.functional.mse_loss(model(x), y)


@pytest.mark.timeout(90)
def test_a_killed_replica_rejoins_and_the_run_equals_the_reference():
    steps, kill = 10, (2, 3)
    run = run_with_failure(_model, _optimizer, _loss, replicas=3, steps=steps, kill=kill,
                           restart_after=2, deadline_s=1.0, timeout_s=5.0)
    assert not descendants(), "a replica process was left behind"
    survivors = [r for r in run.logs if r != kill[0]]
    log = run.logs[survivors[0]]
    assert [s for s, *_ in log] == list(range(steps))
    for r in survivors:  # the survivors agree on every step's quorum, and never restarted
        assert [(s, m) for s, m, *_ in run.logs[r]] == [(s, m) for s, m, *_ in log]
        assert len(run.exit_codes[r]) == 1 and run.exit_codes[r][0] == 0
    quorums = {s: m for s, m, *_ in log}
    assert quorums[kill[1]] == tuple(survivors)  # step k: finished without the killed one
    assert quorums[kill[1] + 1] == tuple(survivors)  # and step k + 1
    assert run.exit_codes[kill[0]][0] == -9  # SIGKILL
    assert kill[1] + 1 < run.rejoined_step < steps  # rejoined later, from a live peer
    assert kill[0] in quorums[run.rejoined_step]
    assert all(kill[0] in quorums[s] for s in range(run.rejoined_step, steps))
    assert run.recovery_bit_identical
    finals = [run.finals[r] for r in sorted(run.finals)]
    for other in finals[1:]:  # every replica ends with the same bits, optimizer state too
        for name, t in finals[0]["model"].items():
            assert torch.equal(t, other["model"][name]), name
        for i, s in finals[0]["optimizer"]["state"].items():
            for key, t in s.items():
                assert torch.equal(t, other["optimizer"]["state"][i][key]), (i, key)
    want = reference_run(_model, _optimizer, _loss, log)
    worst = max((want[n] - t).abs().max().item() for n, t in finals[0]["model"].items())
    assert worst < 1e-6, worst
    assert run.lost_seconds < 3.0
