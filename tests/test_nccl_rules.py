"""NCCL's rules enforced on Gloo: what would fail on the first GPU run fails here first."""

from __future__ import annotations

import pytest
import torch

from engine import RankError
from engine.observe.meter import CommMeter
from engine.comm import ops
from engine.observe.nccl_rules import nccl_rules
from tests.helpers import run_ranks


def _breaks(rank, world_size, what):
    with nccl_rules("cpu"):
        if what == "made without a device":
            elapsed = torch.tensor([0.5])  # the trainer's old step-time bug
            ops.all_reduce(elapsed)
        if what == "placed":
            ops.all_reduce(torch.tensor([0.5]).to("cpu"))
            ops.all_reduce(torch.zeros(2, device="cpu"))
            ops.all_reduce(torch.zeros_like(torch.zeros(2, device="cpu")) + 1)
            return "ran"
        if what == "any source":
            if rank == 0:
                ops.send(torch.ones(1, device="cpu"), 1)
            else:
                ops.recv(torch.ones(1, device="cpu"), None)
        if what == "tag":
            ops.isend(torch.ones(1, device="cpu"), 1 - rank, tag=3).wait()
    with nccl_rules("cuda:0"):
        if what == "wrong device":
            ops.broadcast(torch.ones(1, device="cpu"), 0)


@pytest.mark.parametrize("what, message", [
    ("made without a device", r"ops.all_reduce got a tensor made without a device at "
                              r".*test_nccl_rules.py:\d+ in _breaks, handed over at "
                              r".*test_nccl_rules.py:\d+ in _breaks"),
    ("any source", r"ops.recv from any source \(src=None\), at .*test_nccl_rules.py:\d+"),
    ("tag", r"ops.isend with tag=3, at .*test_nccl_rules.py.*NCCL ignores tags"),
    ("wrong device", r"ops.broadcast got a tensor on cpu, at .*test_nccl_rules.py:\d+ in "
                     r"_breaks, but this rank computes on cuda:0"),
])
def test_each_rule_is_refused_with_the_op_and_the_call_site(what, message):
    with pytest.raises(RankError, match=message):
        run_ranks(_breaks, 2, what)


def test_tensors_placed_on_the_rank_device_pass():
    assert run_ranks(_breaks, 2, "placed") == ["ran", "ran"]


def test_outside_the_rules_gloo_takes_what_it_takes():
    def fn(rank, world_size):
        t = torch.tensor([1.0])
        ops.all_reduce(t)
        return float(t)

    assert run_ranks(fn, 2) == [2.0, 2.0]


def test_torch_distributed_called_directly_is_checked_too():
    def fn(rank, world_size):
        import torch.distributed as dist

        with nccl_rules("cpu"):
            dist.all_reduce(torch.tensor([0.1], dtype=torch.float64), op=dist.ReduceOp.MAX)

    with pytest.raises(RankError, match=r"torch.distributed.all_reduce got a tensor made "
                                        r"without a device at .*test_nccl_rules.py:\d+ in fn"):
        run_ranks(fn, 2)


def test_torch_distributed_is_restored_when_the_rules_close():
    def fn(rank, world_size):
        import torch.distributed as dist

        before = dist.all_reduce
        with nccl_rules("cpu"):
            inside = dist.all_reduce
        return inside is not before and dist.all_reduce is before

    assert run_ranks(fn, 2) == [True, True]


def _p2p_calls(rank, world_size, numel):
    """How the readable ring and the counted collectives post their messages (through
    engine.comm.p2p, the layer the algorithms are built on)."""
    from engine.comm import p2p as o
    from engine.comm import ring_all_reduce

    calls = {"batched": 0, "unbatched": 0}
    batch, isend, irecv = o.batch_isend_irecv, o.isend, o.irecv

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    o.batch_isend_irecv = counting("batched", batch)
    o.isend, o.irecv = counting("unbatched", isend), counting("unbatched", irecv)
    ring_all_reduce(torch.ones(numel))
    ring_calls = dict(calls)
    with CommMeter():
        out = torch.empty(numel * world_size)
        ops.all_to_all_single(out, torch.ones(numel * world_size))
    return ring_calls, dict(calls)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_steps_post_send_and_receive_together_as_nccl_needs(world_size):
    """A lone receive posted before its send blocks NCCL's stream: a two-rank ring hangs.
    Every step of the readable ring (and of the all-to-all) is one batch_isend_irecv."""
    for ring_calls, after_all_to_all in run_ranks(_p2p_calls, world_size, 10):
        assert ring_calls == {"batched": 2 * (world_size - 1), "unbatched": 0}
        assert after_all_to_all == {"batched": 3 * (world_size - 1), "unbatched": 0}


def _stack_walks(rank, world_size, where):
    """How many times the rules walked the stack (``caller()``, ``inspect.stack``): for a few
    valid ops, for an unbatched ``isend`` (``irecv`` on the peer), and for one refused op (an
    any-source receive) where the rules are on."""
    import contextlib
    import inspect

    import torch.distributed as dist

    from engine.launch import device as launch_device
    from engine.observe import nccl_rules as rules

    walks = []
    caller, stack = rules.caller, inspect.stack
    rules.caller = lambda: walks.append("caller") or caller()
    inspect.stack = lambda *a, **k: walks.append("inspect.stack") or stack(*a, **k)
    if where == "on nccl":  # the backend reported as NCCL, the rank's GPU as the CPU
        dist.get_backend = lambda group=None: "nccl"
        launch_device.local_gpu = lambda index=None: torch.device("cpu")
    rules_on = nccl_rules("cpu") if where == "inside nccl_rules()" else contextlib.nullcontext()
    with rules_on:
        t = torch.ones(8, device="cpu")
        ops.all_reduce(t)
        ops.broadcast(t, 0)
        for send_first in (rank == 0, rank == 1):
            ops.send(t, 1 - rank) if send_first else ops.recv(t, 1 - rank)
        for work in ops.batch_isend_irecv([ops.send_op(t, 1 - rank),
                                           ops.recv_op(torch.empty(8, device="cpu"), 1 - rank)]):
            work.wait()
        valid = list(walks)
        (ops.isend(t, 1) if rank == 0 else ops.irecv(t, 0)).wait()
        unbatched = walks[len(valid):]
        if where != "off":
            with pytest.raises(ValueError, match="any source"):
                ops.recv(t, None)
    return valid, unbatched, walks[len(valid) + len(unbatched):]


@pytest.mark.parametrize("where", ["off", "on nccl", "inside nccl_rules()"])
def test_the_rules_walk_the_stack_only_to_name_a_refused_op(where):
    """Off (Gloo, outside ``nccl_rules()``) the rules cost no stack walk; on NCCL or inside
    ``nccl_rules()`` a valid op costs none either (an unbatched ``isend`` may note where it was
    posted, to name it if a blocking receive from its peer comes before it is waited on), and
    a refused op walks once, to say where it was issued."""
    for valid, unbatched, refused in run_ranks(_stack_walks, 2, where):
        assert valid == []
        assert refused == ([] if where == "off" else ["caller"])
        if where == "off":
            assert unbatched == []
        assert "inspect.stack" not in unbatched
