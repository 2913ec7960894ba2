"""``python -m engine train`` refuses what it cannot finish before any rank starts, with one
line naming the flag, the value given and what was expected (engine.train.checks); a loss
that is not finite stops the run naming the step, rank and layer (engine.train.nonfinite); a
damaged checkpoint is one line naming its file and field, or its rank and file, and
``--resume-fallback`` resumes from the one before it, saying so (engine.train.run)."""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import shutil

import pytest
import torch
from torch import nn

from engine.__main__ import main as engine_main
from engine.checkpoint.trainer import complete, step_dir
from engine.train.cli import TrainConfig
from engine.train.checks import check_world
from engine.train.nonfinite import NonFiniteLoss, NonFiniteWatch, first_nonfinite
from tests.helpers import descendants


class Launched(Exception):
    """What the stand-in for engine.launch.launch raises: a rank would have started."""


@pytest.fixture
def no_ranks(monkeypatch):
    """engine.launch.launch replaced: a test that reaches it fails with Launched (its
    arguments noted), so a refusal is proved to come before any rank starts."""
    calls = []

    def launch(fn, world_size, *args, **kwargs):
        calls.append((world_size, args))
        raise Launched(world_size)

    # the module (``engine.launch``, the attribute, is the function it exports)
    monkeypatch.setattr(importlib.import_module("engine.launch"), "launch", launch)
    return calls


def refused(args: list[str], capsys) -> str:
    """``engine train ARGS`` exits 2 with one line on stderr; that line."""
    assert engine_main(["train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


# -- finding 9: bounds on --timeout, --seed, the batch, the world, the folders ---------------

@pytest.mark.parametrize("args, message", [
    (["--timeout", "1e20"], "--timeout must be at most 86,400 seconds (a day"),
    (["--timeout", "1e-6"], "--timeout must be at least 1 second"),
    (["--timeout", "inf"], "--timeout must be a positive number, got inf"),
    (["--seed", str(10**20)], "--seed must be at most 4,294,967,295 (2**32 - 1"),
    (["--micro-batch", str(10**9)], "--micro-batch 1000000000: 1,000,000,000 sequences of 16 "
                                    "tokens (--model tiny) are more than the 1,048,576 tokens "
                                    "(2**20) a micro-batch may hold; expected --micro-batch "
                                    "at most 65,536"),
    (["--microbatches", str(10**9)], "--microbatches 1000000000: a global batch of dp x "
                                     "microbatches x micro-batch = 1 x 1000000000 x 4 "
                                     "sequences of 16 tokens is 64,000,000,000 tokens, more "
                                     "than the 16,777,216 (2**24)"),
    (["--microbatches", "1e9"], "argument --microbatches: invalid int value: '1e9'"),
    (["--resume-fallback", "--save", "D"], "--resume-fallback chooses the checkpoint --resume "
                                           "loads: pass --resume too"),
])
def test_out_of_range_values_are_refused_in_one_line_before_any_rank_starts(
        args, message, capsys, no_ranks):
    assert message in refused(args, capsys)
    assert no_ranks == []


def test_the_seed_s_bound_is_one_the_data_generator_takes():
    from engine.train.checks import MAX_SEED

    # the data of step k is seeded with (seed + 1) x 1,000,003 + k (engine.compose.data)
    torch.Generator().manual_seed((MAX_SEED + 1) * 1_000_003 + 10**9)
    torch.manual_seed(MAX_SEED)


def test_the_world_is_bounded_by_the_machine_s_cores_unless_told(capsys, no_ranks,
                                                                  monkeypatch):
    import engine.train.checks as checks

    monkeypatch.setattr(checks, "usable_cores", lambda: 1)  # 4 per core, at least 8: 8
    err = refused(["--dp", "100000", "--microbatches", "1", "--micro-batch", "1"], capsys)
    assert "--dp 100000 --cp 1 --tp 1 --pp 1: 100,000 ranks, each a process forked on this " \
           "machine, and it runs at most 8 (4 per core x 1 core(s), at least 8)" in err
    assert "--allow-oversubscribe" in err
    assert "at most 8" in refused(["--dp", "9", "--microbatches", "1"], capsys)
    assert no_ranks == []
    with pytest.raises(Launched):  # 8 ranks fit; 9 only when asked for
        engine_main(["train", "--dp", "8", "--microbatches", "1"])
    with pytest.raises(Launched):
        engine_main(["train", "--dp", "9", "--microbatches", "1", "--allow-oversubscribe"])
    assert [world for world, _ in no_ranks] == [8, 9]
    # torchrun's world is torchrun's; NCCL's one GPU per rank is resolve_backend's to check
    cfg = TrainConfig(dp=100000)
    check_world(cfg, 100000, "gloo", under_torchrun=True)
    check_world(cfg, 100000, "nccl", under_torchrun=False)


def test_allow_oversubscribe_runs_more_ranks_than_the_limit(capsys, monkeypatch):
    import engine.train.checks as checks

    monkeypatch.setattr(checks, "rank_limit", lambda: 1)
    assert "runs at most 1" in refused(["--dp", "2", "--steps", "1"], capsys)
    assert engine_main(["train", "--dp", "2", "--steps", "1", "--allow-oversubscribe"]) == 0
    assert "--allow-oversubscribe True" in capsys.readouterr().out
    assert descendants() == []


def _folder_cases(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    return [
        (["--trace", str(tmp_path / "missing" / "t.json")],
         f"--trace {tmp_path / 'missing' / 't.json'}: the folder {tmp_path / 'missing'} does "
         "not exist"),
        (["--trace", "/proc/t.json"], "--trace /proc/t.json: no file can be made in /proc"),
        (["--trace", str(a_file / "t.json")], f"{a_file} is a file, expected a folder"),
        (["--trace", str(tmp_path)], f"--trace {tmp_path}: it is a folder, expected the path "
                                     "of the trace file"),
        (["--save", str(a_file)], f"--save {a_file}: it is a file, expected a folder"),
        (["--save", str(a_file / "run")], f"--save {a_file / 'run'}: {a_file} is a file"),
        (["--save", "/proc/run"], "--save /proc/run: no file can be made in /proc"),
        (["--save", "/proc/self/run/deeper"], "no file can be made in /proc/self"),
    ]


@pytest.mark.parametrize("case", range(8))
def test_save_and_trace_folders_are_checked_before_any_rank_starts(case, tmp_path, capsys,
                                                                    no_ranks):
    args, message = _folder_cases(tmp_path)[case]
    assert message in refused(args, capsys)
    assert no_ranks == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
@pytest.mark.parametrize("flag, name", [("--save", "run"), ("--trace", "t.json")])
def test_a_read_only_folder_is_refused(flag, name, tmp_path, capsys, no_ranks):
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        assert f"no file can be made in {folder}" in refused([flag, str(folder / name)],
                                                             capsys)
    finally:
        folder.chmod(0o755)
    assert no_ranks == []


def test_a_save_folder_with_missing_parents_is_made_as_before(tmp_path, no_ranks):
    deep = tmp_path / "a" / "b" / "run"
    with pytest.raises(Launched):
        engine_main(["train", "--save", str(deep), "--trace", str(tmp_path / "t.json")])
    assert not (tmp_path / "a").exists() and list(tmp_path.iterdir()) == []  # probe removed


# -- finding 10: a loss that is not finite stops the run, naming where ------------------------

def test_a_nonfinite_loss_stops_the_run_naming_the_step_rank_and_layer(tmp_path, capsys):
    save = tmp_path / "run"
    # step 1 is finite; its update at lr 1e308 makes the weights infinite, so step 2 is nan
    assert engine_main(["train", "--dp", "2", "--steps", "3", "--lr", "1e308", "--save",
                        str(save), "--save-every", "1"]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in captured.out + captured.err, err
    assert err.startswith("error: step 2 of 3: the loss is nan, not finite; replayed with a "
                          "forward hook on every layer, the first non-finite value came out "
                          "of layer ")
    # the replay runs on what step 2's update left: every parameter, and says so
    assert re.search(r"\(Embedding\) on rank 0 \(ranks 0, 1 saw one\), where (\d+) of \1 "
                     "parameter tensors are no longer finite after the step's update", err)
    assert "the run stopped before saving step 2; lower --lr (now 1e+308)" in err
    assert err.endswith(f"the newest complete checkpoint: {step_dir(save, 1)}")
    assert [p.name for p in complete(save)] == ["step-00000001"]
    assert descendants() == []


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                         nn.Linear(8, 2))


def test_the_detector_names_the_first_layer_with_a_nonfinite_output():
    model = _mlp()
    x = torch.randn(3, 4)
    assert first_nonfinite(model, x) is None
    with torch.no_grad():
        model[2].weight[0, 0] = float("inf")
    assert first_nonfinite(model, x) == ("2", "Linear")  # not the ReLU or Linear after it
    assert not any(m._forward_hooks for m in model.modules())  # the hooks are taken off


def test_the_detector_finds_the_layer_in_the_gpt_by_its_name():
    from engine.compose.model import GPT
    from engine.train.composed import model_config

    gpt = GPT(model_config(TrainConfig()))
    ids = torch.randint(0, 64, (2, 16))
    assert first_nonfinite(gpt, ids, torch.arange(16)) is None
    with torch.no_grad():
        gpt.blocks[1].fc.weight[3, 5] = float("nan")
    assert first_nonfinite(gpt, ids, torch.arange(16)) == ("blocks.1.fc", "Linear")


def test_a_healthy_step_costs_no_hook_and_a_failing_one_is_replayed_with_hooks():
    model = _mlp()
    x = torch.randn(3, 4)
    watch = NonFiniteWatch(model)
    replays = []
    watch.check(1, 0.5, 4, replay=lambda: replays.append(model(x)))
    assert replays == [] and not any(m._forward_hooks for m in model.modules())
    with torch.no_grad():
        model[4].bias[1] = float("-inf")
    with pytest.raises(NonFiniteLoss, match=r"^step 2 of 4: the loss is -inf, not finite; "
                                            "replayed with a forward hook on every layer, the "
                                            r"first non-finite value came out of layer 4 "
                                            r"\(Linear\) on rank 0, where 1 of 6 parameter "
                                            "tensors are no longer finite after the step's "
                                            "update; try this$") as caught:
        watch.check(2, float("-inf"), 4, advice="try this",
                    replay=lambda: replays.append(model(x)))
    assert len(replays) == 1  # the failing step, run once more
    assert (caught.value.step, caught.value.rank, caught.value.layer) == (2, 0, "4")
    assert not any(m._forward_hooks for m in model.modules())  # the hooks came off
    # nothing flagged: the loss itself overflowed
    with torch.no_grad():
        model[4].bias[1] = 0.0
    with pytest.raises(NonFiniteLoss, match="no layer's output held a non-finite value"):
        watch.check(3, math.nan, replay=lambda: model(x))


# -- finding 11: trainer.json checked, a corrupted rank file named, --resume-fallback ---------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two checkpoints of a dp 2 run (steps 1 and 2), for each test to copy and damage."""
    root = tmp_path_factory.mktemp("saved") / "run"
    assert engine_main(["train", "--dp", "2", "--steps", "2", "--save", str(root),
                        "--save-every", "1"]) == 0
    return root


def _copy(saved, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    return run


def _edit_trainer(run, change) -> str:
    path = step_dir(run, 2) / "trainer.json"
    record = json.loads(path.read_text())
    record = change(record)
    path.write_text(json.dumps(record))
    return str(path)


def _without(record, *keys):
    for key in keys[:-1]:
        record = record[key]
    del record[keys[-1]]


TRAINER_DAMAGE = {
    "step -3": (lambda r: {**r, "step": -3}, "'step' must be 2 (its folder is step-00000002), "
                                             "got -3"),
    "step 3": (lambda r: {**r, "step": 3}, "'step' must be 2 (its folder is step-00000002), "
                                           "got 3"),
    "step a string": (lambda r: {**r, "step": "2"}, "'step' must be 2 (its folder is "
                                                    "step-00000002), got '2'"),
    "no step": (lambda r: (_without(r, "step"), r)[1], "'step' is missing, expected 2"),
    "no config": (lambda r: (_without(r, "config"), r)[1], "'config' is missing"),
    "no dp": (lambda r: (_without(r, "config", "dp"), r)[1],
              "'config.dp' is missing, expected a positive int"),
    "dp a string": (lambda r: {**r, "config": {**r["config"], "dp": "2"}},
                    "'config.dp' must be a positive int, got '2'"),
    "zero 7": (lambda r: {**r, "config": {**r["config"], "zero": 7}},
               "'config.zero' must be 0, 1, 2 or 3, got 7"),
    "a foreign engine": (lambda r: {**r, "config": {**r["config"], "engine": "megatron"}},
                         "'config.engine' must be 'composed' or 'per-layout', got 'megatron'"),
    "losses short": (lambda r: {**r, "losses": r["losses"][:1]},
                     "'losses' must be a list of 2 losses, one per step, got a list of 1"),
    "a nan loss": (lambda r: {**r, "losses": [r["losses"][0], math.nan]},
                   "'losses[1]' must be a finite number (the loss of step 2), got nan"),
    "a list": (lambda r: [r], "its content must be a JSON object with step, config and "
                              "losses, got a list of 1"),
}


@pytest.mark.parametrize("damage", TRAINER_DAMAGE)
def test_a_malformed_trainer_json_is_one_line_naming_the_file_and_field(
        damage, saved, tmp_path, capsys, no_ranks):
    run = _copy(saved, tmp_path)
    change, message = TRAINER_DAMAGE[damage]
    file = _edit_trainer(run, change)
    err = refused(["--dp", "2", "--steps", "4", "--save", str(run), "--resume"], capsys)
    assert err.startswith(f"error: --resume: {file} is malformed: {message}"), err
    assert err.endswith("; pass --resume-fallback to resume from the complete checkpoint "
                        "before it, step-00000001")
    assert no_ranks == []
    assert [p.name for p in complete(run)] == ["step-00000001", "step-00000002"]


def test_a_manifest_of_another_layout_is_named(saved, tmp_path, capsys, no_ranks):
    run = _copy(saved, tmp_path)
    _edit_trainer(run, lambda r: {**r, "config": {**r["config"], "dp": 4}})
    err = refused(["--dp", "2", "--steps", "4", "--save", str(run), "--resume"], capsys)
    assert f"{step_dir(run, 2) / 'manifest.json'} does not match " \
           f"{step_dir(run, 2) / 'trainer.json'}: 'world_size' is 2, expected dp x cp x tp x " \
           "pp = 4" in err
    manifest = step_dir(run, 2) / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "kind": "sharded"}))
    _edit_trainer(run, lambda r: {**r, "config": {**r["config"], "dp": 2}})
    assert f"{manifest} is not a per-rank checkpoint" in refused(
        ["--dp", "2", "--steps", "4", "--save", str(run), "--resume"], capsys)
    assert no_ranks == []


def _corrupt(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_corrupted_rank_file_is_one_line_naming_its_rank_and_file(saved, tmp_path, capsys):
    run = _copy(saved, tmp_path)
    shard = step_dir(run, 2) / "rank1-of2.pt"
    _corrupt(shard)
    assert engine_main(["train", "--dp", "2", "--steps", "4", "--save", str(run),
                        "--resume"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in captured.out + captured.err, err
    assert err == (f"error: --resume: {step_dir(run, 2)} cannot be loaded: rank 1 could not "
                   f"load {step_dir(run, 2)}: {shard} is corrupted: its SHA-256 does not "
                   "match the manifest; pass --resume-fallback to resume from the complete "
                   "checkpoint before it, step-00000001")
    assert [p.name for p in complete(run)] == ["step-00000001", "step-00000002"]
    shard.unlink()
    assert engine_main(["train", "--dp", "2", "--steps", "4", "--save", str(run),
                        "--resume"]) == 2
    assert f"rank 1 could not load {step_dir(run, 2)}: {shard} is missing: the manifest " \
           "lists 2 rank files" in capsys.readouterr().err
    assert descendants() == []


def test_resume_fallback_resumes_from_the_checkpoint_before_and_says_which(saved, tmp_path,
                                                                          capsys):
    run = _copy(saved, tmp_path)
    _corrupt(step_dir(run, 2) / "rank0-of2.pt")
    assert engine_main(["train", "--dp", "2", "--steps", "3", "--save", str(run),
                        "--resume", "--resume-fallback"]) == 0
    out = capsys.readouterr().out
    passed_over = (f"--resume-fallback passed over step-00000002 (moved to "
                   f"damaged-step-00000002): rank 0 could not load {step_dir(run, 2)}: "
                   f"{step_dir(run, 2) / 'rank0-of2.pt'} is corrupted")
    assert f"resumed from {step_dir(run, 1)} after step 1" in out
    assert f"resumed from: {step_dir(run, 1)} ({passed_over}" in out  # the report
    ours = json.loads((step_dir(run, 3) / "trainer.json").read_text())["losses"]
    theirs = json.loads((step_dir(saved, 2) / "trainer.json").read_text())["losses"]
    assert len(ours) == 3 and ours[:2] == theirs  # step 2 trained again, bit for bit
    # the damaged one moved aside, kept, out of the way of pruning and of the next --resume
    assert [p.name for p in complete(run)] == ["step-00000001", "step-00000003"]
    assert (run / "damaged-step-00000002" / "rank0-of2.pt").is_file()
    # a malformed trainer.json is passed over before any rank starts, and named the same way
    run = _copy(saved, tmp_path / "second")
    _edit_trainer(run, lambda r: {**r, "step": -3})
    assert engine_main(["train", "--dp", "2", "--steps", "3", "--save", str(run),
                        "--resume", "--resume-fallback"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from: {step_dir(run, 1)} (--resume-fallback passed over step-00000002 " \
           f"(moved to damaged-step-00000002): {step_dir(run, 2) / 'trainer.json'} is " \
           "malformed: 'step' must be 2" in out
    assert [p.name for p in complete(run)] == ["step-00000001", "step-00000003"]
    assert descendants() == []
