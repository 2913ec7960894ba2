"""Resume on the composed engine is bit-identical for every layout family of the parity matrix
(issue 29): 2 steps, saved (every rank its own state: engine.compose.resume, through the
agreed per-rank protocol), loaded into a freshly built layout, 2 more steps; against 4 steps
in one go, the losses and every tensor of every rank's state (parameters or ZeRO-3 shards,
optimizer moments, compressor residuals) equal by ``torch.equal``. Families: dp2 ZeRO-1, dp2
with a Top-K compressor (error feedback) and with PowerSGD (error feedback, warm-started P and
Q, its random generator), cp2 varlen, tiny-MoE ep2 (ZeRO-1; ZeRO-3), dp2 x tp2 ZeRO-3
(FSDP + TP), dp2 x pp2 (1F1B, ZeRO-2 and ZeRO-3); through ``engine train`` with
``--async-save``, tiny-MoE dp2 x ep2 x pp2 at ZeRO-1. A rank that cannot serialise its state
makes every rank raise, naming it, and leaves no manifest (the agreed protocol). Every
family's files join offline into the whole model, experts spread over ep ranks included
(engine.compose.reshard, which --reshard cuts for another layout: tests/test_compose_reshard.py),
and cut back for the same layout they are every tensor the ranks saved (torch.equal: joins and
cuts only copy); a compressor's are refused naming --compress. Then ``engine train --reshard`` on the
composed path: a dp-only change at ZeRO-0 resumes; --compress is refused naming it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from engine.__main__ import main as engine_main
from engine.model.data import global_batch
from engine.compose.parity import MOE, MODEL
from engine.compose.plan import Plan
from tests.helpers import run_ranks

STEPS, SAVED, ROWS = 4, 2, 4
FAMILIES = {  # name: (plan, moe, varlen)
    "dp2 zero1": (Plan(dp=2, zero=1, micro_batches=2), False, False),
    "dp2 compress topk": (Plan(dp=2, zero=0, compress="topk:0.1"), False, False),
    "dp2 compress powersgd": (Plan(dp=2, zero=0, compress="powersgd:1"), False, False),
    "cp2 varlen": (Plan(cp=2, zero=1), False, True),
    "tiny-moe dp2 ep2 zero1": (Plan(dp=2, ep=2, zero=1), True, False),
    "tiny-moe dp2 ep2 zero3": (Plan(dp=2, ep=2, zero=3), True, False),
    "dp2xtp2 zero3": (Plan(dp=2, tp=2, zero=3), False, False),
    "dp2xpp2 1f1b zero2": (Plan(dp=2, pp=2, zero=2, micro_batches=2), False, False),
    "dp2xpp2 1f1b zero3": (Plan(dp=2, pp=2, zero=3, micro_batches=2), False, False),
    # W actions: ZeRO-2's late buckets, dense and the experts' (engine.zero.stage2)
    "tiny-moe dp2xep2xpp2 zb_h1 zero2": (Plan(dp=2, ep=2, pp=2, zero=2, schedule="zb_h1",
                                              micro_batches=2), True, False),
    # the compressor of a pipeline stage's step all-reduce (its PowerSGD warm start)
    "dp2xpp2 compress powersgd": (Plan(dp=2, pp=2, zero=0, compress="powersgd:1",
                                       micro_batches=2), False, False),
    "tp2 sp": (Plan(tp=2, sequence_parallel=True, micro_batches=2), False, False),
    # two chunks a rank (4 layers), the tied embedding a ZeRO-3 root held through the step
    "dp2xpp2 zb_v zero3": (Plan(dp=2, pp=2, zero=3, schedule="zb_v", micro_batches=2), False,
                           False),
}


def model_config(plan: Plan, moe: bool):
    """The parity matrix's model (MoE: its experts), with 4 layers under a schedule holding
    two chunks a rank."""
    cfg = replace(MODEL, **MOE) if moe else MODEL
    two_chunks = plan.pp > 1 and plan.schedule in ("interleaved", "zb_v", "dualpipe_v")
    return replace(cfg, layers=4) if two_chunks else cfg


def _build(plan: Plan, moe: bool):
    from engine.compose.model import GPT
    from engine.compose.parallelize import parallelize
    from engine.moe.layer import single_rank_group
    from engine.topology import Mesh

    mesh = Mesh(dp=plan.dp, tp=plan.tp, pp=plan.pp, cp=plan.cp, ep=plan.ep)
    cfg = model_config(plan, moe)
    gpt = GPT(cfg, seed=0, expert_group=single_rank_group() if moe else None)
    return parallelize(gpt, mesh, plan, torch.optim.AdamW, lr=1e-3)


def _steps(par, first: int, last: int, varlen: bool) -> list[float]:
    from engine.compose.loop import train_step

    cfg = par.model.cfg
    return [train_step(par, global_batch(k, ROWS, cfg.seq_len, cfg.vocab, 1, varlen), k)
            for k in range(first, last)]


def _state(par) -> dict:
    from engine.checkpoint.snapshot import host_copy
    from engine.compose.resume import rank_state

    tensors, optimizer = rank_state(par)
    return host_copy({"model": tensors.state_dict(), "optimizer": optimizer.state_dict()})


def _flat(value, prefix=""):
    """Every tensor of a nested state, by its path."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, (list, tuple)) else ()
    return {k: v for key, item in items for k, v in _flat(item, f"{prefix}/{key}").items()}


def _resume_families(rank, world_size, names, root):
    from engine.checkpoint.per_rank import load_per_rank, save_per_rank
    from engine.compose.resume import rank_state

    found = {}
    for name in names:
        plan, moe, varlen = FAMILIES[name]
        whole = _build(plan, moe)
        straight = _steps(whole, 0, STEPS, varlen)
        first = _build(plan, moe)
        losses = _steps(first, 0, SAVED, varlen)
        directory = f"{root}/{name.replace(' ', '_')}"
        save_per_rank(directory, *rank_state(first))
        again = _build(plan, moe)
        load_per_rank(directory, *rank_state(again))
        loaded = _state(again)
        losses += _steps(again, SAVED, STEPS, varlen)
        found[name] = {"straight": straight, "resumed": losses, "whole": _state(whole),
                       "again": _state(again)}
        if not plan.compress:  # joined and cut for its own layout: what the rank saved
            from engine.compose.reshard import reshard

            recut = _build(plan, moe)
            reshard(directory, recut)
            found[name]["loaded"], found[name]["recut"] = loaded, _state(recut)
        if name == names[0]:  # a rank that cannot serialise: every rank raises, no manifest
            found["failed save"] = _failed_save(rank, first, f"{directory}-failed")
        if plan.compress:  # the same resume without the compressor's memory: not the same run
            from engine.compress.spec import make_compressor

            lost = _build(plan, moe)
            load_per_rank(directory, *rank_state(lost))
            lost.compressing.compressor = make_compressor(plan.compress)  # as fresh
            _steps(lost, SAVED, STEPS, varlen)
            found[name]["without compressor state"] = _state(lost)
    return found


def _failed_save(rank, par, directory) -> tuple[str, bool]:
    from pathlib import Path

    from engine.checkpoint.files import MANIFEST, CheckpointError
    from engine.checkpoint.per_rank import save_per_rank
    from engine.compose.resume import rank_state

    tensors, optimizer = rank_state(par)
    if rank == 1:
        def no_space():
            raise OSError("[Errno 28] No space left on device")
        tensors.state_dict = no_space
    try:
        save_per_rank(directory, tensors, optimizer)
        message = ""
    except CheckpointError as e:
        message = str(e)
    return message, (Path(directory) / MANIFEST).exists()


def _check(ranks, name):
    for rank, found in enumerate(ranks):
        run = found[name]
        assert run["straight"] == run["resumed"], (name, rank, run)
        a, b = _flat(run["whole"]), _flat(run["again"])
        assert a.keys() == b.keys() and len(a) > 0, (name, rank)
        different = [k for k in a if not torch.equal(a[k], b[k])]
        assert not different, (name, rank, different)
        if "recut" in run:  # --reshard's path into the same layout: every tensor equal
            a, b = _flat(run["loaded"]), _flat(run["recut"])
            assert a.keys() == b.keys() and any("/optimizer/" in k for k in a), (name, rank)
            different = [k for k in a if not torch.equal(a[k], b[k])]
            assert not different, (name, rank, different)
        if "without compressor state" in run:
            lost = _flat(run["without compressor state"])
            assert any(not torch.equal(a[k], lost[k]) for k in a if "/model/" in k), name


@pytest.mark.parametrize("world", [2, 4])
def test_every_layout_family_resumes_bit_identical(world, tmp_path):
    names = [n for n, (plan, _, _) in FAMILIES.items() if plan.world == world]
    ranks = run_ranks(_resume_families, world, names, str(tmp_path), timeout=240)
    for name in names:
        _check(ranks, name)
        _check_join(FAMILIES[name], tmp_path / name.replace(" ", "_"))
    for message, manifest in (found["failed save"] for found in ranks):
        assert "rank 1" in message and "No space left on device" in message and not manifest


def _check_join(family, directory):
    """The per-rank files of ``family`` join offline into every parameter of the one-process
    GPT, each moment beside it (engine.compose.reshard.universal_state); a compressor's
    residuals have no place there: refused naming --compress."""
    from engine.checkpoint.files import CheckpointError
    from engine.compose.model import GPT
    from engine.compose.reshard import universal_state

    plan, moe, _ = family
    cfg = model_config(plan, moe)
    if plan.compress:
        with pytest.raises(CheckpointError, match=f"--compress {plan.compress}"):
            universal_state(directory, cfg)
        return
    state = universal_state(directory, cfg)
    shapes = {name: p.shape for name, p in GPT(cfg).named_parameters(remove_duplicate=False)}
    assert {name: p.shape for name, p in state.params.items()} == shapes, directory
    for key in ("exp_avg", "exp_avg_sq"):
        assert {name: p.shape for name, p in state.moments[key].items()} == shapes, key
    assert {k: v.item() for k, v in state.scalars.items()} == {"step": float(SAVED)}


def test_engine_train_resumes_moe_ep2_pp2_zero1_bit_identical_with_async_save(tmp_path):
    """The command line's wiring (engine.checkpoint.trainer saving the composed rank's state, in the
    background with --async-save): tiny-MoE dp2 x ep2 x pp2 at ZeRO-1, 2 steps + 2 resumed
    against 4, every rank's file equal tensor for tensor."""
    from engine.checkpoint.per_rank import read_rank_state

    layout = ["--model", "tiny-moe", "--dp", "2", "--ep", "2", "--pp", "2",
              "--zero", "1", "--microbatches", "2", "--micro-batch", "2", "--async-save"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert engine_main(["train", *layout, "--steps", "4", "--save", str(whole)]) == 0
    assert engine_main(["train", *layout, "--steps", "2", "--save", str(split)]) == 0
    assert engine_main(["train", *layout, "--steps", "4", "--save", str(split),
                        "--resume"]) == 0
    assert _losses(whole) == _losses(split) and len(_losses(whole)) == 4
    for rank in range(4):
        a, b = (_flat(read_rank_state(root / "step-00000004", rank)) for root in (whole, split))
        assert a.keys() == b.keys() and any("/optimizer/" in k for k in a), rank
        assert all(torch.equal(a[k], b[k]) for k in a), rank


def _losses(root) -> list[float]:
    last = sorted(p for p in root.iterdir() if p.name.startswith("step-"))[-1]
    return json.loads((last / "trainer.json").read_text())["losses"]


def test_reshard_a_dp_only_change_at_zero0_and_refuse_compress(tmp_path, capsys):
    """dp2 (ZeRO-0) saved after 2 steps, resumed on one rank with twice the micro-batches (the
    same global batch): the same losses as dp2 straight through within 1e-6 (another order of
    the sums: dp2 equals one process within 1e-6 in the parity matrix). --compress is refused
    before any rank starts, naming it. (A tp or ZeRO change, once refused here, is re-cut now:
    tests/test_compose_reshard.py.)"""
    dp2 = ["--dp", "2", "--zero", "0", "--microbatches", "1", "--micro-batch",
           "2"]
    one = ["--world-size", "1", "--zero", "0", "--microbatches", "2",
           "--micro-batch", "2"]
    assert engine_main(["train", *dp2, "--steps", "4", "--save", str(tmp_path / "a")]) == 0
    assert engine_main(["train", *dp2, "--steps", "2", "--save", str(tmp_path / "b")]) == 0
    assert engine_main(["train", *one, "--steps", "4", "--save", str(tmp_path / "b"),
                        "--resume", "--reshard"]) == 0
    assert "(re-cut for this layout)" in capsys.readouterr().out
    straight, resharded = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert len(straight) == len(resharded) == 4 and straight[:2] == resharded[:2]
    assert max(abs(a - b) for a, b in zip(straight, resharded)) <= 1e-6, (straight, resharded)
    from engine.train.cli import TrainConfig
    from engine.train.composed import check_composed

    # (engine train refuses --save with --compress earlier still, in engine.train.checks)
    compressed = TrainConfig(dp=2, zero=0, compress="topk:0.1", resume=True,
                             reshard=True, save=str(tmp_path / "b"))
    with pytest.raises(ValueError, match="--reshard with the composed engine") as refused:
        check_composed(compressed, 2)
    assert "--compress topk:0.1" in str(refused.value)
