"""engine.launch, isolated: a hung rank is named within a minute by default (finding 13), no
process a rank started outlives the launch, however it detached (13), the ranks listen on
loopback only (14), and they meet through a store no other user can reach (15)."""

from __future__ import annotations

import inspect
import ipaddress
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch.distributed as dist

from engine import RankDiedError, RankError, RankTimeoutError, launch
from engine.launch import (
    DEFAULT_SPAWN_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    DEFAULT_TORCHRUN_TIMEOUT_S,
    entry,
)
from engine.launch.reaper import descendants as tree_below
from tests.helpers import descendants, is_running

# -- 13: the default timeout ------------------------------------------------------------------


def test_the_default_timeout_is_60_s_forked_and_300_s_spawned_or_under_torchrun(monkeypatch):
    assert DEFAULT_TIMEOUT_S == 60
    assert DEFAULT_SPAWN_TIMEOUT_S == DEFAULT_TORCHRUN_TIMEOUT_S == 300
    assert inspect.signature(launch).parameters["timeout"].default is None
    seen = []

    class Recorded:
        def __init__(self, fn, world_size, args, backend, timeout, *rest):
            seen.append(timeout)

        def run(self):
            return []

    monkeypatch.setattr(entry, "Launch", Recorded)
    launch(_module_level, 2)
    launch(_module_level, 2, start_method="spawn")
    launch(_module_level, 2, timeout=7)
    monkeypatch.setattr(entry, "run_in_this_process",
                        lambda fn, n, args, backend, timeout, env: seen.append(timeout))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    launch(_module_level, 2)
    assert seen == [60, 300, 7, 300]


def _module_level(rank, world_size):
    return rank


def _hangs_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(3600)  # alive, never joins
    dist.barrier()


def test_a_hung_rank_is_named_within_the_default_timeout(monkeypatch):
    """The path a launch without ``timeout=`` takes, with the default made short to keep
    the test fast: the hung rank is named once it has passed, not five minutes later."""
    monkeypatch.setattr(entry, "DEFAULT_TIMEOUT_S", 1.5)
    start = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        launch(_hangs_on_rank_1, 3, quiet=True)
    assert 1.5 <= time.monotonic() - start < 1.5 + 4.0
    assert info.value.ranks == [1]
    assert "rank 1 did not finish within 1.5 s" in str(info.value)
    assert descendants() == []


# -- 13: nothing a rank started outlives the launch ---------------------------------------------


def _processes_running(argv: list[str]) -> list[int]:
    """Pids of the live processes whose command line is exactly ``argv``, from /proc."""
    want, found = "\0".join(argv).encode() + b"\0", []
    for entry_ in Path("/proc").iterdir():
        if entry_.name.isdigit():
            try:
                if (entry_ / "cmdline").read_bytes() == want and is_running(int(entry_.name)):
                    found.append(int(entry_.name))
            except OSError:
                pass
    return found


def _start_daemon(argv: list[str]) -> None:
    """A daemon as the books make one: fork, ``setsid`` in the child, start the program from
    there and let the child exit, so the program is orphaned and in a session of its own."""
    child = os.fork()
    if child == 0:
        try:
            os.setsid()
            subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        finally:
            os._exit(0)
    os.waitpid(child, 0)


def _leaves_a_daemon(rank, world_size, argv, how):
    _start_daemon(argv)
    deadline = time.monotonic() + 10
    while not _processes_running(argv) and time.monotonic() < deadline:
        time.sleep(0.01)  # started: the rank's end is what must take it along
    if how == "raises":
        raise ValueError("after starting a daemon")
    if how == "exits":
        os._exit(3)  # the rank itself ends at once, without a word
    if how == "hangs" and rank == 1:
        time.sleep(3600)
    dist.barrier()
    return rank


@pytest.mark.parametrize("how, error", [("returns", None), ("raises", RankError),
                                        ("exits", RankDiedError),
                                        ("hangs", RankTimeoutError)])
def test_a_daemon_a_rank_started_does_not_outlive_the_launch(how, error):
    argv = ["sleep", f"1000.{uuid.uuid4().int % 10**9}"]  # this test's, and nobody else's
    bystander_argv = ["sleep", f"1001.{uuid.uuid4().int % 10**9}"]
    bystander = subprocess.Popen(bystander_argv, start_new_session=True)  # not the launch's
    try:
        if error is None:
            assert launch(_leaves_a_daemon, 2, argv, how, timeout=30, quiet=True) == [0, 1]
        else:
            with pytest.raises(error):
                launch(_leaves_a_daemon, 2, argv, how, timeout=3 if how == "hangs" else 30,
                       quiet=True)
        assert _processes_running(argv) == [], "a rank's daemon outlived the launch"
        assert [p for p in descendants() if p != bystander.pid] == []
        assert bystander.poll() is None and _processes_running(bystander_argv) == [
            bystander.pid], "the launch killed a process that was not the ranks'"
    finally:
        bystander.kill()
        bystander.wait()


_KILLED_WHILE_A_DAEMON_RUNS = textwrap.dedent("""
    import sys, time
    from engine import launch
    from tests.test_launch_isolation import _processes_running, _start_daemon
    def rank(r, ws, argv):
        if r == 0:
            _start_daemon(argv)
        time.sleep(3600)
    launch(rank, 2, sys.argv[1:], timeout=600, quiet=True)
""")


def test_a_daemon_dies_with_a_launching_process_that_is_killed(tmp_path):
    """kill -9 of the launching process: each rank's keeper is told (SIGTERM, its parent-death
    signal) and still ends what its rank started."""
    argv = ["sleep", f"1000.{uuid.uuid4().int % 10**9}"]
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WHILE_A_DAEMON_RUNS, *argv],
                            cwd=Path(__file__).resolve().parent.parent,
                            env=dict(os.environ, TMPDIR=str(tmp_path)))  # its leftover logs
    try:
        deadline = time.monotonic() + 60
        while not _processes_running(argv):
            assert time.monotonic() < deadline and proc.poll() is None, "no daemon started"
            time.sleep(0.05)
        below = tree_below(proc.pid)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    deadline = time.monotonic() + 5
    while (_processes_running(argv) or any(is_running(p) for p in below)) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_running(argv) == [] and not [p for p in below if is_running(p)]


# -- 14: loopback only ------------------------------------------------------------------------


def _socket_inodes(pids: list[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    return inodes


def _address(hex_address: str) -> str:
    """/proc/net/tcp{,6}'s ``ADDR:PORT`` (the address in host byte order, 32-bit words)."""
    address = bytes.fromhex(hex_address.split(":")[0])
    words = b"".join(address[i:i + 4][::-1] for i in range(0, len(address), 4))
    return str(ipaddress.ip_address(words))


def listening_addresses(pids: list[int]) -> list[str]:
    """The address each TCP socket of ``pids`` listens on (IPv4 and IPv6), from /proc/net."""
    inodes, found = _socket_inodes(pids), []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(_address(fields[1]))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None
                              and ip.ipv4_mapped.is_loopback)


def _listeners_of_the_launch(rank, world_size, launcher):
    dist.barrier()  # every rank's Gloo listener is up, and stays up until the barrier below
    found = None
    if rank == 0:
        found = (listening_addresses([launcher, *tree_below(launcher)]),
                 os.environ.get("GLOO_SOCKET_IFNAME"))
    dist.barrier()
    return found


def test_a_local_launch_listens_on_loopback_only():
    """While two ranks run, no process of the launch (this one, the keepers, the ranks)
    listens on anything but loopback: the store is a file, Gloo is told to use ``lo``."""
    addresses, interface = launch(_listeners_of_the_launch, 2, os.getpid(), timeout=30,
                                  quiet=True)[0]
    assert interface == "lo"
    assert len(addresses) >= 2, addresses  # a Gloo listener per rank, at least
    assert all(is_loopback(a) for a in addresses), addresses


def test_a_store_process_listens_on_loopback_only():
    """engine.ft's store (:func:`engine.launch.rank.store_main`), still TCP: on 127.0.0.1."""
    from engine.ft.harness import store_in_a_process

    with store_in_a_process(10) as store:
        store.set("k", "v")
        addresses = listening_addresses(tree_below(os.getpid()))
    assert addresses == ["127.0.0.1"]


# -- 15: a store only this user can reach -----------------------------------------------------


@pytest.fixture
def shared_tmp(monkeypatch):
    """A temporary directory every user may enter (as /tmp), for the launch's own: so what
    keeps another user out is the launch's directory, not a private one above it."""
    top = tempfile.mkdtemp(prefix="engine-test-shared-", dir="/tmp")
    os.chmod(top, 0o1777)
    monkeypatch.setattr(tempfile, "tempdir", top)
    yield Path(top)
    shutil.rmtree(top, ignore_errors=True)


def _store_of_the_launch(rank, world_size, top):
    [directory] = [p for p in Path(top).iterdir() if p.name.startswith("engine-launch-")]
    info = os.stat(directory)
    here = sorted(p.name for p in directory.iterdir())
    dist.barrier()
    return str(directory), info.st_mode & 0o777, info.st_uid, here


def test_the_store_is_a_file_in_a_directory_of_this_user_alone(shared_tmp):
    directory, mode, uid, names = launch(_store_of_the_launch, 2, str(shared_tmp), timeout=30,
                                         quiet=True)[0]
    assert mode == 0o700 and uid == os.getuid()
    assert "store" in names
    assert not Path(directory).exists()  # removed when the launch ended


def _as_nobody(rank, world_size, top):
    """A child of rank 0 becomes user nobody and tries what another local user could."""
    [directory] = [p for p in Path(top).iterdir() if p.name.startswith("engine-launch-")]
    store_path = directory / "store"
    assert store_path.exists()
    tried = []
    if rank == 0:
        reader, writer = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(reader)
            out = []
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                os.listdir(top)  # the shared directory above: open to nobody
                out.append("entered the shared directory")
                for name, attempt in (
                        ("list the launch's directory", lambda: os.listdir(directory)),
                        ("read the store", lambda: open(store_path, "rb").read()),
                        ("append to the store", lambda: open(store_path, "ab").write(b"x")),
                        ("open it as a FileStore",
                         lambda: dist.FileStore(str(store_path), -1).get("default_pg/0//cpu//0"))):
                    try:
                        attempt()
                        out.append(f"COULD {name}")
                    except PermissionError:
                        out.append(f"denied: {name}")
                    except Exception as e:  # noqa: BLE001 - torch's own error for a refusal
                        out.append(f"denied: {name} ({type(e).__name__})"
                                   if "ermission" in str(e) else f"COULD? {name}: {e}")
            except BaseException as e:  # noqa: BLE001
                out.append(f"error {type(e).__name__}: {e}")
            finally:
                os.write(writer, "\n".join(out).encode())
                os._exit(0)
        os.close(writer)
        os.waitpid(child, 0)
        with os.fdopen(reader) as f:
            tried = f.read().splitlines()
    dist.barrier()  # the store is still in use while the child tried
    return tried


@pytest.mark.skipif(os.geteuid() != 0,
                    reason="switching to user nobody (65534) to try the store needs root")
def test_another_user_cannot_reach_the_store(shared_tmp):
    tried = launch(_as_nobody, 2, str(shared_tmp), timeout=30, quiet=True)[0]
    assert tried[0] == "entered the shared directory", tried  # nobody it is, and may look
    assert len(tried) == 5 and all(t.startswith("denied: ") for t in tried[1:]), tried
