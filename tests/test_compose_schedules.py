"""``engine train --pp 2 --schedule S`` on the composed engine for every schedule of the
registry (engine.pp.SCHEDULES: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2, ZB-V, DualPipeV):
each on 2 ranks equal to one process within 1e-6, losses and parameters, on a 4-layer model
(the interleaved and V schedules hold 2 chunks of one layer per rank); the command line runs
a multi-chunk one with the loss of ``--world-size 1``. What a schedule cannot run is refused
before any rank starts, naming the values."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from engine.__main__ import main as engine_main
from engine.compose.loop import train
from engine.compose.model import GPT
from engine.compose.parallelize import parallelize
from engine.compose.parity import LR, MODEL as PARITY_MODEL, ROWS, SEED, TOLERANCE, reference
from engine.compose.plan import Plan
from engine.pp import SCHEDULES
from tests.helpers import run_ranks

MODEL = replace(PARITY_MODEL, layers=4)  # 2 chunks of one layer per rank on 2 ranks
MICRO_BATCHES, STEPS = 4, 2


def _every_schedule(rank, world_size):
    from engine.compose.state import dense_state
    from engine.topology import Mesh

    found = {}
    for name in SCHEDULES:
        plan = Plan(pp=2, schedule=name, micro_batches=MICRO_BATCHES)
        plan.check(MODEL, ROWS)
        par = parallelize(GPT(MODEL, seed=SEED), Mesh(pp=2), plan, torch.optim.AdamW, lr=LR)
        found[name] = {"losses": train(par, STEPS, ROWS, seed=SEED + 1),
                       "state": dense_state(par)}
    return found


def test_every_schedule_trains_as_one_process():
    """Each schedule on 2 ranks (one launch for all of them) against one process: the loss of
    every step and every parameter each stage holds, within 1e-6 (another order of the sums:
    the micro-batches' gradients accumulate in the schedule's order)."""
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved", "zb_h1", "zb_h2", "zb_v",
                              "dualpipe_v"}  # a new schedule: add it here (and its check)
    ranks = run_ranks(_every_schedule, 2, timeout=240)
    one = reference(MODEL, False, STEPS)
    for name in SCHEDULES:
        for rank in ranks:
            run = rank[name]
            assert max(abs(a - b) for a, b in zip(run["losses"], one["losses"], strict=True)) \
                <= TOLERANCE, (name, run["losses"], one["losses"])
            assert run["state"], name
            diff = max((t - one["state"][n]).abs().max().item() for n, t in run["state"].items())
            assert diff <= TOLERANCE, (name, diff)


def test_engine_train_runs_a_multi_chunk_schedule(capsys):
    """The command line: DualPipeV (2 chunks a rank, the V placement: the loss on rank 0) with
    --pp 2 on the 4-layer preset, the loss per step of --world-size 1 within 1e-6."""
    common = ["--model", "small", "--microbatches", "4", "--micro-batch", "1", "--steps", "2"]

    def losses(args):
        assert engine_main(["train", *args, *common]) == 0
        out = capsys.readouterr().out
        line = next(line for line in out.splitlines() if line.startswith("  loss per step ("))
        return [float(x) for x in re.findall(r"\d+\.\d+", line.split(":", 1)[1])]

    alone = losses(["--world-size", "1"])
    piped = losses(["--pp", "2", "--schedule", "dualpipe_v"])
    assert len(alone) == len(piped) == 2
    assert max(abs(a - b) for a, b in zip(alone, piped)) <= TOLERANCE, (alone, piped)


@pytest.mark.parametrize("args, message", [
    (["--schedule", "dualpipe_v", "--microbatches", "2"],
     "DualPipeV needs m (micro-batches) >= 2p = 4, got m=2"),
    (["--schedule", "interleaved", "--microbatches", "3", "--micro-batch", "4"],
     "interleaved 1F1B needs m (micro-batches) to be a multiple of p (stages): got m=3, p=2"),
    (["--schedule", "zb_v", "--model", "tiny"],
     "cuts the model into 4 chunks of at least one layer each, the model has 2 layers"),
    (["--schedule", "interleaved", "--pp", "3", "--model", "medium", "--microbatches", "3"],
     "pp = 3 with schedule 'interleaved' cuts the model into pp x chunks per rank = 6 equal "
     "chunks: 6 must divide layers = 8"),
    (["--schedule", "1f1b", "--pp", "3", "--model", "small", "--microbatches", "3"],
     "3 must divide layers = 4"),
])
def test_what_a_schedule_cannot_run_is_refused_naming_the_values(args, message, capsys):
    assert engine_main(["train", "--pp", "2", *args]) == 2
    assert message in capsys.readouterr().err


# ZeRO-3 under the schedules with W actions: dp2 x pp2 (every unit really sharded over 2
# ranks), 8 rows so that dp x m = 2 x 4 divides them (DualPipeV needs m >= 2p = 4)
ZERO3_W = [("zb_h1", True), ("zb_h2", True), ("zb_v", False),  # V placement: untied
           ("dualpipe_v", False)]
ZERO3_ROWS = 8


def _zero3_under_w(rank, world_size):
    from engine.observe.meter import CommMeter
    from engine.compose.formulas import layout_formulas
    from engine.compose.state import dense_state
    from engine.compose.traffic import bytes_by_kind
    from engine.topology import Mesh

    found = {}
    for name, tied in ZERO3_W:
        cfg = replace(MODEL, tied=tied)
        plan = Plan(dp=2, pp=2, zero=3, schedule=name, micro_batches=MICRO_BATCHES)
        plan.check(cfg, ZERO3_ROWS)
        mesh = Mesh(dp=2, pp=2)
        par = parallelize(GPT(cfg, seed=SEED), mesh, plan, torch.optim.AdamW, lr=LR)
        assert par.sharding.late_groups, name  # the linear layers' groups wait for W
        with CommMeter(count="wire") as meter:
            losses = train(par, STEPS, ZERO3_ROWS, seed=SEED + 1)
        rows = ZERO3_ROWS // (plan.dp * plan.micro_batches)
        found[name] = {"losses": losses, "state": dense_state(par),
                       "peak": par.sharding.peak_gathered_bytes,
                       "largest": max(sum(p.layout.shape.numel() * 4 for p in g.params)
                                      for g in par.sharding.groups),
                       "dp": bytes_by_kind(meter.events, mesh, False)["dp"],
                       "formula": layout_formulas(par, rows, STEPS)["dp"].bytes}
    return found


def _one_process(cfg, steps, rows):
    from engine.model.data import global_batch
    from engine.compose.loss import masked_sum

    model = GPT(cfg, seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for k in range(steps):
        batch = global_batch(k, rows, cfg.seq_len, cfg.vocab, SEED + 1)
        optimizer.zero_grad()
        loss = masked_sum(model(batch.ids), batch.targets, batch.mask) / batch.tokens
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone()
                    for n, p in model.named_parameters(remove_duplicate=False)}


def test_zero3_under_every_schedule_with_w_actions_trains_as_one_process():
    """ZeRO-3 over dp2 x pp2 under ZB-H1, ZB-H2 (tied embedding), ZB-V and DualPipeV (untied:
    the V placement's tied weight is still refused): each W action's ``dW = dY^T X`` goes into its
    unit's gradient and is reduce-scattered there. Losses and every parameter within 1e-6 of
    one process (not exactly equal: the micro-batches' gradients are summed in the schedule's
    order and averaged by a reduce-scatter, one process sums the whole batch at once), and the
    dp bytes counted on the wire equal to the formula (ZB-H1: one reduce-scatter of every unit
    per micro-batch as under 1F1B; V: the units of a B twice, the linear layers' once). At
    most one unit whole at a time, as under 1F1B: a linear layer's unit is freed once B has
    used its weight (W needs none)."""
    ranks = run_ranks(_zero3_under_w, 4, timeout=240)
    for name, tied in ZERO3_W:
        losses, state = _one_process(replace(MODEL, tied=tied), STEPS, ZERO3_ROWS)
        for rank in ranks:
            run = rank[name]
            assert max(abs(a - b) for a, b in zip(run["losses"], losses, strict=True)) \
                <= TOLERANCE, (name, run["losses"], losses)
            diff = max((t - state[n]).abs().max().item() for n, t in run["state"].items())
            assert run["state"] and diff <= TOLERANCE, (name, diff)
            assert run["dp"] == run["formula"], (name, run["dp"], run["formula"])
            assert run["peak"] == run["largest"], (name, run["peak"], run["largest"])


def test_engine_train_runs_zero3_under_zb_h1(capsys):
    """The command line: --dp 2 --pp 2 --zero 3 --schedule zb_h1 (the tiny model, tied), the
    loss per step of --world-size 1 on the same global batch within 1e-6, and every rank's dp
    bytes printed equal to its formula."""
    def run(args):
        assert engine_main(["train", *args, "--microbatches", "2",
                            "--steps", "2"]) == 0
        out = capsys.readouterr().out
        line = next(line for line in out.splitlines() if line.startswith("  loss per step ("))
        return [float(x) for x in re.findall(r"\d+\.\d+", line.split(":", 1)[1])], out

    alone, _ = run(["--world-size", "1", "--micro-batch", "4"])
    zero3, out = run(["--dp", "2", "--pp", "2", "--zero", "3", "--schedule", "zb_h1",
                      "--micro-batch", "2"])
    assert len(alone) == len(zero3) == 2
    assert max(abs(a - b) for a, b in zip(alone, zero3)) <= TOLERANCE, (alone, zero3)
    dp = re.findall(r"dp ([\d,]+) B = ([\d,]+) B", out)
    assert len(dp) == 4 and all(a == b for a, b in dp), dp


def _zero2_small_buckets_under_w(rank, world_size):
    from engine.observe.meter import CommMeter
    from engine.compose.formulas import layout_formulas
    from engine.compose.state import dense_state
    from engine.compose.traffic import bytes_by_kind
    from engine.topology import Mesh

    found = {}
    for name in ("zb_h1", "zb_v"):
        plan = Plan(dp=2, pp=2, zero=2, schedule=name, micro_batches=MICRO_BATCHES)
        plan.check(MODEL, ZERO3_ROWS)
        mesh = Mesh(dp=2, pp=2)
        par = parallelize(GPT(MODEL, seed=SEED), mesh, plan, torch.optim.AdamW, lr=LR,
                          bucket_cap_mb=0.004)  # ~4 KB: a stage's parameters in many buckets
        late = par.optimizer.grad_sharding.late_buckets
        with CommMeter(count="wire") as meter:
            losses = train(par, STEPS, ZERO3_ROWS, seed=SEED + 1)
        rows = ZERO3_ROWS // (plan.dp * plan.micro_batches)
        found[name] = {"losses": losses, "state": dense_state(par),
                       "buckets": (len(late), len(par.optimizer.buckets)),
                       "dp": bytes_by_kind(meter.events, mesh, False)["dp"],
                       "formula": layout_formulas(par, rows, STEPS)["dp"].bytes}
    return found


def test_zero2_with_many_buckets_under_w_actions_sends_its_formula():
    """ZeRO-2 under ZB-H1 and ZB-V with buckets of ~4 KB (many a stage, some holding one
    chunk's parameters, some another's): the buckets holding linear weights wait for W, and
    each W reduce-scatters every one of them (engine.zero.late), as each backward pass does
    every bucket, so the dp bytes counted equal the formula's m x chunks reduce-scatters of
    every bucket whatever the buckets hold; losses and parameters within 1e-6 of one process
    (a different order of sums, not exact)."""
    ranks = run_ranks(_zero2_small_buckets_under_w, 4, timeout=240)
    losses, state = _one_process(MODEL, STEPS, ZERO3_ROWS)
    for rank in ranks:
        for name, run in rank.items():
            late, buckets = run["buckets"]
            assert buckets > 4 and 0 < late <= buckets, (name, run["buckets"])
            assert max(abs(a - b) for a, b in zip(run["losses"], losses, strict=True)) \
                <= TOLERANCE, (name, run["losses"], losses)
            diff = max((t - state[n]).abs().max().item() for n, t in run["state"].items())
            assert run["state"] and diff <= TOLERANCE, (name, diff)
            assert run["dp"] == run["formula"], (name, run["dp"], run["formula"])
