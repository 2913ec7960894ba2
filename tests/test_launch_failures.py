"""Failure injection: a rank that raises, dies, hangs, or is interrupted never hangs the caller.

Each case must end within its deadline, name the rank at fault, and leave no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine import RankDiedError, RankError, RankTimeoutError, launch
from tests.helpers import descendants, is_running


def _raises_on_rank_1(rank, world_size):
    print(f"rank {rank} is about to sync")
    dist.barrier()  # every rank has printed
    if rank == 1:
        raise ValueError("bad shard size 7 on rank 1")
    dist.barrier()  # the others wait here for rank 1, who never comes
    return rank


def test_a_rank_that_raises_is_named_with_its_traceback(capfd):
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(_raises_on_rank_1, 4, timeout=60)
    elapsed = time.monotonic() - start
    err = info.value
    assert elapsed < 2.0, f"siblings were not stopped promptly ({elapsed:.1f} s)"
    assert err.rank == 1 and err.ranks == [1] and err.exc_type == "ValueError"
    assert "rank 1 raised ValueError: bad shard size 7 on rank 1" in str(err)
    assert "_raises_on_rank_1" in err.traceback and "test_launch_failures.py" in err.traceback
    assert isinstance(err.__cause__, ValueError)  # the original exception, re-created
    assert "[rank 3] rank 3 is about to sync" in capfd.readouterr().out  # output still shown
    assert descendants() == []


def test_the_caller_can_launch_again_after_a_failure():
    with pytest.raises(RankError):
        launch(_raises_on_rank_1, 2, timeout=60, quiet=True)
    assert launch(lambda r, ws: r * 10, 2, timeout=30, quiet=True) == [0, 10]


def _exits_on_rank_2(rank, world_size):
    if rank == 2:
        os._exit(3)
    dist.barrier()


def test_a_rank_that_exits_is_named_with_its_exit_code():
    start = time.monotonic()
    with pytest.raises(RankDiedError) as info:
        launch(_exits_on_rank_2, 4, timeout=60, quiet=True)
    assert time.monotonic() - start < 2.0
    assert info.value.ranks == [2]
    assert "rank 2 exited with code 3 without returning a result" in str(info.value)
    assert descendants() == []


def _killed_on_rank_0(rank, world_size):
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_a_rank_killed_by_a_signal_is_named():
    start = time.monotonic()
    with pytest.raises(RankDiedError, match="rank 0 was killed by signal SIGKILL") as info:
        launch(_killed_on_rank_0, 3, timeout=60, quiet=True)
    assert time.monotonic() - start < 2.0
    assert info.value.ranks == [0]
    assert descendants() == []


def _stuck_on_rank_3(rank, world_size):
    if rank == 3:
        time.sleep(3600)  # alive, but never joins the barrier
    dist.barrier()


def test_a_stuck_rank_is_named_once_the_timeout_passes():
    timeout = 2.0
    start = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        launch(_stuck_on_rank_3, 4, timeout=timeout, quiet=True)
    elapsed = time.monotonic() - start
    assert timeout <= elapsed < timeout + 4.0
    assert info.value.ranks == [3], str(info.value)
    assert "rank 3 did not finish within 2 s" in str(info.value)
    assert descendants() == []


def test_a_rank_stuck_outside_any_collective_is_named_at_the_deadline():
    def sleepy(rank, world_size):
        if rank == 1:
            time.sleep(3600)
        return rank

    with pytest.raises(RankTimeoutError) as info:
        launch(sleepy, 3, timeout=1.0, quiet=True)
    assert info.value.ranks == [1]
    assert descendants() == []


def test_an_unpicklable_result_is_a_clear_error():
    with pytest.raises(RankError, match="returned a value that cannot be sent back"):
        launch(lambda r, ws: (lambda: None), 2, timeout=30, quiet=True)
    assert descendants() == []


_INTERRUPTIBLE = textwrap.dedent("""
    import json, os, signal, sys, time
    from pathlib import Path
    from engine import launch
    # A shell's background job starts with SIGINT ignored; a terminal or Jupyter would not.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    pid_dir = Path(sys.argv[1])
    def sleeper(rank, ws):
        (pid_dir / f"{rank}.pid").write_text(str(os.getpid()))
        time.sleep(3600)
    try:
        launch(sleeper, 4, timeout=600, quiet=True)
    except KeyboardInterrupt:
        again = launch(lambda r, ws: r, 2, timeout=30, quiet=True)  # still usable
        print(json.dumps({"interrupted": True, "again": again}))
""")


def _wait_for_pids(pid_dir: Path, n: int, timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(pid_dir.glob("*.pid"))
        if len(files) == n and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    raise AssertionError(f"ranks did not start: {list(pid_dir.iterdir())}")


def test_an_interrupt_stops_every_rank_and_the_caller_stays_usable(tmp_path):
    """Ctrl-C in a terminal, or Jupyter's interrupt button: SIGINT to the launching process."""
    proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTIBLE, str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = _wait_for_pids(tmp_path, 4)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()  # no-op once it has exited; after a failure, takes its ranks with it
    assert time.monotonic() - start < 3.0
    assert proc.returncode == 0, err
    assert '"interrupted": true, "again": [0, 1]' in out
    assert not [p for p in pids if is_running(p)], "ranks outlived the interrupt"


def test_ranks_die_with_a_parent_that_is_killed(tmp_path):
    """Even kill -9 of the launching process (no chance to clean up) leaves no rank behind."""
    proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTIBLE, str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, TMPDIR=str(tmp_path)))  # its leftover logs
    pids = _wait_for_pids(tmp_path, 4)
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 5
    while any(is_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if is_running(p)], "ranks were orphaned"


# Root cause, not symptom: found by review, each once blamed the wrong rank.


def _deadlock(rank, world_size):
    dist.recv(torch.empty(1), (rank + 1) % world_size)  # everyone receives, nobody sends


def test_a_deadlock_names_every_rank_and_says_deadlock():
    with pytest.raises(RankTimeoutError) as info:
        launch(_deadlock, 3, timeout=1.5, quiet=True)
    assert info.value.ranks == [0, 1, 2]
    assert "deadlock: every rank was waiting for another" in str(info.value)
    assert descendants() == []


def _returns_early(rank, world_size):
    if rank == 0:
        return "done"  # forgets to send
    dist.recv(torch.empty(1), 0)


def test_a_rank_that_returned_early_is_pointed_out():
    with pytest.raises(RankError) as info:
        launch(_returns_early, 2, timeout=10, quiet=True)
    assert "rank 0 had already returned: is every send matched by a receive" in str(info.value)


def _own_timeout_error(rank, world_size):
    if rank == 0:
        raise TimeoutError("data loader timed out reading shard 7")
    time.sleep(2)


def test_a_users_own_timeout_error_is_the_failure_not_a_symptom():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(_own_timeout_error, 2, timeout=30, quiet=True)
    assert info.value.ranks == [0] and info.value.exc_type == "TimeoutError"
    assert time.monotonic() - start < 2.0


def test_processes_a_rank_started_are_stopped_too(tmp_path):
    def starts_a_child(rank, world_size, mode):
        child = subprocess.Popen(["sleep", "600"])
        (tmp_path / f"{mode}{rank}.pid").write_text(str(child.pid))
        if mode == "exit" and rank == 1:
            os._exit(4)
        return rank

    assert launch(starts_a_child, 2, "ok", timeout=30, quiet=True) == [0, 1]
    with pytest.raises(RankDiedError):
        launch(starts_a_child, 2, "exit", timeout=30, quiet=True)
    time.sleep(0.2)
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 4 and not [p for p in pids if is_running(p)]


def _aborts_after_saying_why(rank, world_size):
    dist.barrier()
    if rank == 1:
        print("terminate called after throwing an instance of 'gloo::IoException'", flush=True)
        os.abort()
    dist.barrier()


def test_a_died_rank_is_named_with_its_last_output_even_when_quiet():
    # an abort in C++ leaves no Python traceback; what it printed last is often the only why
    with pytest.raises(RankDiedError) as info:
        launch(_aborts_after_saying_why, 2, timeout=30, quiet=True)
    message = str(info.value)
    assert message.startswith("rank 1 was killed by signal SIGABRT; its last output:")
    assert "gloo::IoException" in message
    assert descendants() == []


def _dies_tearing_down(rank, world_size):
    dist.barrier()
    if rank == 1:  # as Gloo's transport thread may abort while the group is destroyed
        dist.destroy_process_group = os.abort
    return rank * 10


def test_a_rank_that_dies_tearing_down_after_its_result_still_returns_it():
    assert launch(_dies_tearing_down, 2, timeout=30, quiet=True) == [0, 10]
    assert descendants() == []


def test_fn_may_destroy_the_process_group_itself():
    def tidy(rank, world_size):
        dist.barrier()
        dist.destroy_process_group()
        return rank

    assert launch(tidy, 2, timeout=30, quiet=True) == [0, 1]


class _BadStr(Exception):
    def __str__(self):
        raise RuntimeError("no str")


class _UnpicklableInParent:
    def __reduce__(self):
        return (int, ("not a number",))


def test_odd_exceptions_and_results_still_name_the_rank():
    def bad_str(rank, world_size):
        raise _BadStr()

    failed_str = "rank 0 raised _BadStr: <str\\(\\) of the exception failed"
    with pytest.raises(RankError, match=failed_str):
        launch(bad_str, 1, timeout=30, quiet=True)
    unpickled = "rank 0 raised ValueError: its return value could not be unpickled by the caller"
    with pytest.raises(RankError, match=unpickled):
        launch(lambda r, ws: _UnpicklableInParent(), 1, timeout=30, quiet=True)


@pytest.mark.parametrize("delay", [0.0, 0.005, 0.01, 0.02, 0.04])
def test_an_interrupt_while_ranks_are_starting_leaves_none_behind(delay):
    import threading

    timer = threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGINT))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupted = False
    try:
        timer.start()
        launch(lambda r, ws: time.sleep(30), 8, timeout=60, quiet=True)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        while timer.is_alive() or not interrupted:  # the interrupt may land anywhere up to here
            try:
                timer.join()
                time.sleep(0.05)
                break
            except KeyboardInterrupt:
                interrupted = True
        signal.signal(signal.SIGINT, previous)
    assert interrupted
    assert descendants() == []


# NCCL does not raise when a collective times out: its watchdog thread prints this line and
# aborts the process (SIGABRT). Simulated on CPU with the same line and the same signal.
_WATCHDOG_LINE = ("[PG ID 0 PG GUID 0(default_pg) Rank {rank}] Watchdog caught collective "
                  "operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, NumelIn=1, "
                  "NumelOut=1, Timeout(ms)=1000) ran for 1001 milliseconds before timing out.")


def _watchdog_aborts_all_but_rank_2(rank, world_size):
    if rank == 2:
        time.sleep(3600)  # alive, but never joins the collective
    time.sleep(0.2 * (world_size - rank))  # rank 0 is aborted last, as it may well be
    print(_WATCHDOG_LINE.format(rank=rank), file=sys.stderr, flush=True)
    os.abort()


def test_ranks_aborted_by_the_nccl_watchdog_are_not_blamed():
    """The ranks the watchdog killed were waiting for rank 2: the report names rank 2."""
    with pytest.raises(RankTimeoutError) as info:
        launch(_watchdog_aborts_all_but_rank_2, 3, timeout=30, quiet=True)
    assert info.value.ranks == [2], str(info.value)
    assert "rank 2 did not finish" in str(info.value)
    assert "timed out waiting for them" in str(info.value)
    assert "Watchdog caught collective operation timeout" in str(info.value)
    assert descendants() == []


def _watchdog_aborts_every_rank(rank, world_size):
    print(_WATCHDOG_LINE.format(rank=rank), file=sys.stderr, flush=True)
    os.abort()


def test_every_rank_aborted_by_the_watchdog_is_a_deadlock():
    with pytest.raises(RankTimeoutError, match="deadlock: every rank was waiting") as info:
        launch(_watchdog_aborts_every_rank, 2, timeout=30, quiet=True)
    assert info.value.ranks == [0, 1]


def _watchdog_aborts_rank_0_and_rank_1_loses_it(rank, world_size):
    if rank == 1:  # still joining when its peer was aborted: it sees the connection go
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    print(_WATCHDOG_LINE.format(rank=rank), file=sys.stderr, flush=True)
    os.abort()


def test_a_rank_that_lost_its_watchdog_aborted_peer_is_part_of_the_deadlock():
    """The race CI met: a rank can see its aborted peer's connection close before its own
    watchdog fires. Both were waiting: both are named."""
    with pytest.raises(RankTimeoutError, match="deadlock: every rank was waiting") as info:
        launch(_watchdog_aborts_rank_0_and_rank_1_loses_it, 2, timeout=30, quiet=True)
    assert info.value.ranks == [0, 1]


def test_a_rank_that_aborts_on_its_own_is_still_named():
    """SIGABRT without the watchdog's line is the rank's own failure, reported as before."""
    def aborts(rank, world_size):
        if rank == 1:
            os.abort()
        dist.barrier()

    with pytest.raises(RankDiedError, match="rank 1 was killed by signal SIGABRT") as info:
        launch(aborts, 2, timeout=30, quiet=True)
    assert info.value.ranks == [1]


def test_cuda_in_a_forked_rank_after_the_parent_touched_it_says_what_to_do():
    """What torch raises in a forked child once the parent has initialised CUDA (no GPU here to
    provoke it for real: scripts/gpu_check.sh does), carried back with the way out."""
    def uses_cuda(rank, world_size):
        raise RuntimeError("Cannot re-initialize CUDA in forked subprocess. To use CUDA with "
                           "multiprocessing, you must use the 'spawn' start method")

    with pytest.raises(RankError) as info:
        launch(uses_cuda, 1, timeout=30, quiet=True)
    message = str(info.value)
    assert "torch.cuda.is_available()" in message
    assert "start_method='spawn'" in message and "module level" in message
