"""``engine.observe.nccl_rules`` makes no text while nothing is refused: an unbatched send and a
tensor made without a device are noted as a :class:`~engine.observe.nccl_rules.Site` (a code
object and a line), turned into ``file:line in function`` only when a refusal names them, and
that text names the very line that posted the send or made the tensor."""

from __future__ import annotations

import re

import pytest
import torch

from engine import RankError
from engine.observe import nccl_rules as rules
from engine.comm import ops
from tests.helpers import run_ranks


def _valid_then(rank, world_size, refused: str):
    texts = []
    caller, site_text = rules.caller, rules.Site.__str__
    rules.caller = lambda: texts.append("caller") or caller()
    rules.Site.__str__ = lambda self: texts.append("Site") or site_text(self)
    peer = 1 - rank
    with rules.nccl_rules("cpu"):
        t = torch.ones(4, device="cpu")
        for _ in range(3):  # valid: sends posted unbatched and waited before any receive
            (ops.isend(t, peer) if rank == 0 else ops.irecv(t, peer)).wait()
            flag = torch.zeros(1)  # made without a device, never handed to an op
        ops.all_reduce(t)
        if texts or not hasattr(flag, "_engine_made_without_device"):
            raise RuntimeError(f"valid ops made text: {texts}")
        if refused == "behind a send":
            ops.isend(t, peer)  # both ranks: a send still pending, then
            ops.recv(t, peer)  # a blocking receive from the same peer
        else:
            ops.all_reduce(torch.zeros(2))


@pytest.mark.parametrize("refused, named", [
    ("behind a send", r"still pending \(posted at .*test_loop_nccl_rules_cost\.py:{line} in "
                      r"_valid_then\)"),
    ("made without a device", r"a tensor made without a device at "
                              r".*test_loop_nccl_rules_cost\.py:{line} in _valid_then, "),
])
def test_no_text_is_made_until_a_refusal_which_names_the_exact_line(refused, named):
    with pytest.raises(RankError) as raised:
        run_ranks(_valid_then, 2, refused)
    message = str(raised.value)  # the refusal itself (valid ops making text fail otherwise)
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1)
                if text.strip().startswith(
                    "ops.isend(t, peer)  # both" if refused == "behind a send"
                    else "ops.all_reduce(torch.zeros(2))"))
    assert re.search(named.format(line=line), message), message[-2000:]
