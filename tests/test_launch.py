"""engine.launch: results, output capture, ports, bad input, torchrun and spawn paths."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from engine import launch
from tests.helpers import descendants, run_ranks


def _all_reduce_rank(rank, world_size):
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    return t


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_in_rank_order_and_tensors_come_back(world_size):
    results = run_ranks(lambda rank, ws: (rank, ws, os.getpid()), world_size)
    assert [r[:2] for r in results] == [(r, world_size) for r in range(world_size)]
    assert len({r[2] for r in results}) == world_size  # one process per rank
    assert os.getpid() not in {r[2] for r in results}
    total = sum(range(world_size))
    for t in run_ranks(_all_reduce_rank, world_size):
        assert torch.equal(t, torch.full((3,), float(total)))


def test_extra_args_reach_every_rank():
    data = torch.arange(4.0)
    assert run_ranks(lambda r, ws, d, k: float(d[r]) * k, 4, data, 10) == [0.0, 10.0, 20.0, 30.0]


def test_output_is_captured_and_printed_in_rank_order(capfd):
    def noisy(rank, world_size):
        time.sleep(0.05 * (world_size - rank))  # finish in reverse order
        print(f"hello from {rank}")
        print(f"warning from {rank}", file=sys.stderr)
        os.write(1, f"c-level {rank}\n".encode())  # what C++ code (Gloo) writes lands too
        return rank

    launch(noisy, 3, backend="gloo", timeout=30)
    out = capfd.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("[rank ")]
    assert lines == [f"[rank {r}] {what}" for r in range(3)
                     for what in (f"hello from {r}", f"warning from {r}", f"c-level {r}")]


def test_quiet_launch_prints_nothing(capfd):
    launch(lambda r, ws: print("shh"), 2, timeout=30, quiet=True)
    assert "shh" not in capfd.readouterr().out


def test_no_process_is_left_behind_after_success():
    run_ranks(_all_reduce_rank, 4)
    assert descendants() == []


def test_two_launches_at_once_do_not_collide(tmp_path):
    """Each launch's rendezvous store takes a port the OS hands out, so parallel runs coexist."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from engine import launch
        def work(rank, ws):
            t = torch.ones(1000)
            for _ in range(10):
                dist.all_reduce(t)
            return int(t[0])
        print(launch(work, 3, timeout=60, quiet=True))
    """))
    jobs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
            for _ in range(3)]
    outs = [job.communicate(timeout=90)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0, 0]
    assert all(out.strip() == str([3 ** 10] * 3) for out in outs)


@pytest.mark.parametrize("bad, message", [
    (dict(world_size=0), "world_size must be an int >= 1, got 0"),
    (dict(world_size=-2), "got -2"),
    (dict(world_size=2.0), "got 2.0"),
    (dict(fn=42), "fn must be callable, got 42"),
    (dict(backend="mpi"), "backend must be one of ('auto', 'gloo', 'nccl'), got 'mpi'"),
    (dict(timeout=0), "timeout must be a positive number of seconds, got 0"),
    (dict(start_method="thread"), "got 'thread'"),
])
def test_bad_input_is_rejected_before_any_process_starts(bad, message):
    kwargs = dict(fn=lambda r, ws: None, world_size=2) | bad
    fn, world_size = kwargs.pop("fn"), kwargs.pop("world_size")
    with pytest.raises(ValueError) as info:
        launch(fn, world_size, **kwargs)
    assert message in str(info.value)
    assert descendants() == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine with no GPU")
def test_nccl_without_gpus_is_a_clear_error():
    with pytest.raises(ValueError, match="backend='nccl' needs CUDA GPUs.*use backend='gloo'"):
        launch(lambda r, ws: None, 2, backend="nccl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks 'auto' on a machine with no GPU")
def test_auto_picks_gloo_on_cpu():
    assert run_ranks(lambda r, ws: dist.get_backend(), 2) == ["gloo", "gloo"]
    assert launch(lambda r, ws: dist.get_backend(), 2, timeout=30, quiet=True) == ["gloo"] * 2


def test_spawn_needs_an_importable_function():
    with pytest.raises(ValueError, match="must be picklable.*Define fn at module level"):
        launch(lambda r, ws: None, 2, start_method="spawn")


def test_spawn_runs_a_module_level_function():
    results = launch(_all_reduce_rank, 2, start_method="spawn", timeout=90, quiet=True)
    assert [t.tolist() for t in results] == [[1.0, 1.0, 1.0]] * 2


def test_under_torchrun_fn_runs_in_this_process(tmp_path):
    """With RANK/WORLD_SIZE set (as torchrun sets them) launch runs fn here, once per process."""
    script = tmp_path / "lab.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist
        from engine import launch
        def work(rank, ws):
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t)
            return (rank, ws, os.getpid(), float(t))
        out = launch(work, int(os.environ["WORLD_SIZE"]), timeout=60)
        print("RESULT", out, os.getpid())
    """))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(2)]
    outs = [p.communicate(timeout=90)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    for r, out in enumerate(outs):
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
        results, pid = eval(line.removeprefix("RESULT ").rsplit(" ", 1)[0]), line.rsplit(" ", 1)[1]
        assert [x[:2] for x in results] == [(0, 2), (1, 2)]  # every rank's result, in order
        assert [x[3] for x in results] == [3.0, 3.0]
        assert results[r][2] == int(pid)  # this rank's fn ran in this very process


def test_under_torchrun_a_mismatched_world_size_is_an_error(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="world_size=2 but this process was started with "
                                         "WORLD_SIZE=4"):
        launch(lambda r, ws: None, 2)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_backend_choice_on_a_machine_with_one_gpu(monkeypatch):
    """The NCCL rules, checked without a GPU by pretending one is there."""
    from engine.launch import resolve_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert resolve_backend("auto", 1) == "nccl"
    assert resolve_backend("auto", 2) == "gloo"  # NCCL needs one GPU per rank
    assert resolve_backend("nccl", 1) == "nccl"
    with pytest.raises(ValueError, match="world_size=2 but only 1 GPU\\(s\\) are visible. "
                                         "Use backend='gloo'"):
        resolve_backend("nccl", 2)
