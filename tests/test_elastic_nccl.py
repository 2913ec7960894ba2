"""Lost peers on NCCL, checked on the CPU: the trainer says at its start that a lost peer shows
up as NCCL's watchdog timeout after --timeout, and when NCCL's timeout error reaches Python,
PeerLostError names the ranks on this host whose processes are gone."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys

import torch.distributed as dist

from engine.launch.elastic import Peer, PeerLostError, Peers, tell_how_nccl_loses_peers
from tests.helpers import run_ranks

NCCL_TIMEOUT = ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, "
                "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=7000) ran for 7002 "
                "milliseconds before timing out.")


def test_nccl_s_timeout_error_names_the_ranks_that_are_gone():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    here = Peer(host, os.getpid())
    peers = Peers.of([here, Peer(host, dead.pid), Peer(host, os.getppid())], here)
    lost = peers.lost(RuntimeError(NCCL_TIMEOUT))
    assert isinstance(lost, PeerLostError) and lost.ranks == [1]
    assert f"lost peer: rank 1 (pid {dead.pid} on {host}) is gone" in str(lost)
    assert "Watchdog caught collective operation timeout" in str(lost)
    assert peers.lost(ValueError("a bug of our own")) is None


def _told(rank, world_size, backend):
    if backend == "nccl":  # the note's path, on Gloo ranks that read as NCCL
        dist.get_backend = lambda group=None: "nccl"
    out = io.StringIO()
    return tell_how_nccl_loses_peers(7.0, out), out.getvalue()


def test_the_trainer_says_on_nccl_that_a_lost_peer_is_a_watchdog_timeout():
    (nccl0, said0), (nccl1, said1) = run_ranks(_told, 2, "nccl")
    assert nccl0 and nccl1 and said1 == ""  # rank 0 says it, once
    assert "on NCCL a lost peer raises no error here" in said0
    assert "after --timeout 7 s" in said0 and "Watchdog caught collective operation timeout" \
        in said0 and "--max-restarts" in said0
    assert run_ranks(_told, 2, "gloo") == [(False, ""), (False, "")]
