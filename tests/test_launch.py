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
    (dict(world_size=0), "world_size must be a positive int, got 0"),
    (dict(world_size=-2), "got -2"),
    (dict(world_size=2.0), "got 2.0"),
    (dict(fn=42), "fn must be callable, got 42"),
    (dict(backend="mpi"), "backend must be one of 'auto', 'gloo', 'nccl'; got 'mpi'"),
    (dict(timeout=0), "timeout (seconds) must be a positive number, got 0"),
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


def _pretend_gpus(monkeypatch, n: int) -> list[str]:
    """Make this process report ``n`` GPUs (and NCCL); return the list of CUDA queries made."""
    asked: list[str] = []

    def is_available():
        asked.append("is_available")
        return True

    def device_count():
        asked.append("device_count")
        return n

    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    monkeypatch.setattr(torch.cuda, "device_count", device_count)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    return asked


def test_backend_choice_on_a_machine_with_one_gpu(monkeypatch):
    """The NCCL rules, checked without a GPU by pretending one is there: NCCL only when asked
    for, and then one GPU per rank."""
    from engine.launch import resolve_backend

    _pretend_gpus(monkeypatch, 1)
    assert resolve_backend("auto", 1) == "gloo"  # a CPU lesson stays on the CPU
    assert resolve_backend("auto", 2) == "gloo"
    assert resolve_backend("nccl", 1) == "nccl"
    with pytest.raises(ValueError, match="world_size=2 but only 1 GPU\\(s\\) are visible. "
                                         "Use backend='gloo'"):
        resolve_backend("nccl", 2)


def test_auto_keeps_a_notebook_launch_on_gloo_on_an_8_gpu_machine(monkeypatch):
    """A closure (as a notebook cell defines it) forked onto Gloo, and the launch asks CUDA
    nothing: a parent that asked could no longer fork ranks that use CUDA."""
    asked = _pretend_gpus(monkeypatch, 8)
    offset = 100  # captured by the closure: it could not be pickled for spawn

    def lesson(rank, world_size):
        t = torch.tensor([float(rank + offset)])
        dist.all_reduce(t)
        keeper = os.getppid()  # the rank's keeper (engine.launch.rank), which forked it
        with open(f"/proc/{keeper}/stat") as f:
            return dist.get_backend(), float(t), int(f.read().rsplit(")", 1)[1].split()[1])

    results = launch(lesson, 2, timeout=30, quiet=True)
    assert [r[:2] for r in results] == [("gloo", 201.0)] * 2
    assert {r[2] for r in results} == {os.getpid()}  # forked by this very process (its keeper)
    assert asked == []


def test_nccl_is_still_there_when_asked_for(monkeypatch):
    """backend='nccl' on the pretend machine goes to spawn, so a closure is refused."""
    _pretend_gpus(monkeypatch, 8)
    with pytest.raises(ValueError, match="start_method='spawn'.*must be picklable"):
        launch(lambda r, ws: None, 2, backend="nccl")


class _Joined(Exception):
    """Raised instead of joining a process group, once the arguments are recorded."""


def test_under_torchrun_an_nccl_rank_names_its_gpu_to_the_group(monkeypatch):
    """LOCAL_RANK 1 of 2 on an 8-GPU node: bound to cuda:1 before the group exists, and the
    group told so (device_id), so the first barrier cannot guess another GPU."""
    _pretend_gpus(monkeypatch, 8)
    for name, value in dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1",
                            LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(name, value)
    calls = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))

    def init_process_group(backend, **kwargs):
        calls["init"] = (backend, kwargs)
        raise _Joined

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with pytest.raises(_Joined):
        launch(lambda r, ws: None, 4, backend="nccl")
    assert calls["set_device"] == torch.device("cuda", 1)
    backend, kwargs = calls["init"]
    assert backend == "nccl" and kwargs["device_id"] == torch.device("cuda", 1)


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_under_torchrun_every_rank_refuses_nccl_with_too_few_gpus(monkeypatch, local_rank):
    """torchrun --nproc-per-node 2 on a 1-GPU node: both ranks give the same clear error
    (before, local rank 0 took NCCL and waited for a peer that could not come)."""
    _pretend_gpus(monkeypatch, 1)
    for name, value in dict(RANK=local_rank, WORLD_SIZE="2", LOCAL_RANK=local_rank,
                            LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("joined"))
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=2 but only 1 GPU"):
        launch(lambda r, ws: None, 2, backend="nccl")


# Run by torchrun itself: reports a 1-GPU machine, launches with the default backend, and
# says which backend it got and whether it is the process that reports.
_TORCHRUN_LAB = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    torch.cuda.is_available = lambda: True  # a 1-GPU machine, as far as anyone asks
    torch.cuda.device_count = lambda: 1
    from engine import launch
    from engine.launch import is_global_rank_zero

    def work(rank, ws):
        t = torch.ones(1)
        dist.all_reduce(t)
        return dist.get_backend(), float(t)

    results = launch(work, int(os.environ["WORLD_SIZE"]), timeout=60)
    with open(os.path.join(sys.argv[1], os.environ["RANK"]), "w") as f:
        f.write(repr(dict(rank=int(os.environ["RANK"]), local_rank=int(os.environ["LOCAL_RANK"]),
                          results=results, reporter=is_global_rank_zero(),
                          group_left=dist.is_initialized())))
""")


def _write_lab(tmp_path):
    (tmp_path / "lab.py").write_text(_TORCHRUN_LAB)
    (tmp_path / "results").mkdir()


def _torchrun(tmp_path, *flags):
    """torchrun FLAGS lab.py RESULTS_DIR: each process writes what it saw to RESULTS_DIR/RANK."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *flags,
                             str(tmp_path / "lab.py"), str(tmp_path / "results")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _results(tmp_path) -> list[dict]:
    """What each torchrun process saw, by global rank."""
    found = [eval(f.read_text()) for f in (tmp_path / "results").iterdir()]
    return sorted(found, key=lambda r: r["rank"])


@pytest.mark.timeout(180)
def test_torchrun_with_more_processes_than_gpus_is_one_backend_and_one_reporter(tmp_path):
    """torchrun --nproc-per-node 2 on a (pretend) 1-GPU machine: both ranks on Gloo (before,
    local rank 0 chose NCCL and rank 1 Gloo), and after the launch, with the group destroyed,
    exactly global rank 0 says it reports."""
    _write_lab(tmp_path)
    job = _torchrun(tmp_path, "--standalone", "--nproc-per-node", "2")
    out = job.communicate(timeout=150)[0]
    assert job.returncode == 0, out
    found = _results(tmp_path)
    assert [(r["rank"], r["local_rank"]) for r in found] == [(0, 0), (1, 1)], out
    for r in found:
        assert r["results"] == [("gloo", 2.0), ("gloo", 2.0)]
        assert r["group_left"] is False  # the reporter is decided after the group is gone
    assert [r["reporter"] for r in found] == [True, False]


@pytest.mark.timeout(180)
def test_two_torchrun_agents_have_one_global_rank_zero(tmp_path):
    """Two nodes of one process each: LOCAL_RANK is 0 on both, yet only global rank 0 is the
    reporter."""
    _write_lab(tmp_path)
    port = str(_free_port())
    jobs = [_torchrun(tmp_path, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
                      "1", "--master-addr", "127.0.0.1", "--master-port", port)
            for node in range(2)]
    outs = [job.communicate(timeout=150)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], outs
    found = _results(tmp_path)
    assert [(r["rank"], r["local_rank"]) for r in found] == [(0, 0), (1, 0)], outs
    assert [r["reporter"] for r in found] == [True, False]


def test_importing_the_engine_starts_nothing_and_skips_dynamo():
    """``import engine`` and ``import engine.theory`` load no torch._dynamo (the launcher
    imports it before its first fork), start no thread and no process."""
    code = textwrap.dedent("""
        import os, sys, threading
        import engine, engine.theory
        children = [p for p in os.listdir("/proc") if p.isdigit()
                    and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]
                    == str(os.getpid())]
        print(sorted(m for m in sys.modules if m.startswith("torch._dynamo")),
              threading.active_count(), children)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[] 1 []"


def test_the_first_fork_brings_dynamo_along():
    """What the import no longer does, the first forked launch does: the ranks inherit it."""
    code = textwrap.dedent("""
        import sys
        from engine import launch
        print(launch(lambda r, ws: "torch._dynamo" in sys.modules, 2, quiet=True, timeout=60),
              "torch._dynamo" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[True, True] True"


def test_the_launch_environment_is_one_frozen_record():
    """RANK, WORLD_SIZE, LOCAL_* and torchelastic's variables, read in one place."""
    import dataclasses

    from engine.launch import LaunchEnv

    env = LaunchEnv.read(dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                              MASTER_ADDR="node0", MASTER_PORT="29500",
                              TORCHELASTIC_RESTART_COUNT="1", TORCHELASTIC_MAX_RESTARTS="2",
                              TORCHELASTIC_USE_AGENT_STORE="True"))
    assert env == LaunchEnv(rank=3, world_size=4, local_rank=1, local_world_size=2,
                            under_torchrun=True, master_addr="node0", master_port=29500,
                            restart_count=1, max_restarts=2, agent_store_shared=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.rank = 0
    assert LaunchEnv.read({}) == LaunchEnv()  # no launch: rank 0 of 1, not under torchrun
    # LOCAL_WORLD_SIZE unset: every rank on this machine, the same on every process
    assert LaunchEnv.read(dict(RANK="1", WORLD_SIZE="4", LOCAL_RANK="1")).local_world_size == 4
    with pytest.raises(ValueError, match="LOCAL_RANK must be an int, got 'x'"):
        LaunchEnv.read(dict(LOCAL_RANK="x"))


def test_only_the_launch_environment_reads_the_rank_variables():
    """No other engine module reads RANK, WORLD_SIZE, LOCAL_* or TORCHELASTIC_* itself."""
    import ast
    from pathlib import Path

    def reads_them(source: str) -> bool:  # uses os.environ and names one of the variables
        nodes = list(ast.walk(ast.parse(source)))
        return any(isinstance(n, ast.Attribute) and n.attr == "environ" for n in nodes) and any(
            isinstance(n, ast.Constant) and isinstance(n.value, str)
            and n.value.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "TORCHELASTIC_"))
            for n in nodes)

    root = Path(__file__).resolve().parent.parent / "engine"
    readers = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                     if reads_them(p.read_text()))
    assert readers == ["launch/env.py"]


def test_one_resolve_backend_with_nccl_preferred_only_when_asked(monkeypatch):
    """``engine train``'s auto (prefer_nccl) takes the GPUs when there is one per local rank;
    the launcher's auto stays on Gloo and asks CUDA nothing. engine.train.cli uses the same one."""
    from engine.launch import resolve_backend
    from engine.train.cli import resolve_backend as train_resolve_backend

    assert train_resolve_backend is resolve_backend
    asked = _pretend_gpus(monkeypatch, 2)
    assert resolve_backend("auto", 8) == "gloo" and asked == []
    assert resolve_backend("auto", 2, prefer_nccl=True) == "nccl"
    assert resolve_backend("auto", 3, prefer_nccl=True) == "gloo"
    assert resolve_backend("gloo", 2, prefer_nccl=True) == "gloo"
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=3 but only 2 GPU"):
        resolve_backend("nccl", 3, "LOCAL_WORLD_SIZE", prefer_nccl=True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert resolve_backend("auto", 1, prefer_nccl=True) == "gloo"


def test_engine_launch_is_the_function_and_the_package():
    """``engine.launch(fn, n)`` is the function; ``engine.launch`` the package still answers
    ``from engine.launch import ...`` and ``unittest.mock.patch("engine.launch.X")``."""
    code = textwrap.dedent("""
        import sys
        from unittest import mock
        import engine
        import engine.launch
        from engine.launch import LaunchError, launch, supervisor
        assert engine.launch is launch and callable(engine.launch)
        package = sys.modules["engine.launch"]
        with mock.patch("engine.launch.is_global_rank_zero", lambda: "patched"):
            assert package.is_global_rank_zero() == "patched"
        with mock.patch("engine.launch.supervisor.DEADLINE_GRACE_S", 9.0):
            assert supervisor.DEADLINE_GRACE_S == 9.0
        print(engine.launch(lambda r, ws: r, 2, quiet=True, timeout=60))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[0, 1]"
