"""Exercise ch11.quorum_average: average a tensor over the live replicas of this step's
quorum, and over nobody else.

Fill in ``quorum_average``, save, then run ``check("ch11.quorum_average")`` in
course/11_slow_links.ipynb (or ``make grade``). The check starts 4 replicas as real processes
and hands each a quorum (an ``engine.ft.Quorum``) in which some replicas are missing: the
missing ones never call your function (in a real run they are dead, or late). Every member
must get the mean of the members' tensors.

There is no global process group to lean on: a dead replica would hang it. Build a Gloo group
of the quorum's members only, over the ``store`` they share (what engine.ft's per-step fault
tolerance does at every new quorum, and torchft too):

* ``dist.PrefixStore(prefix, store)``: a namespace in the store, one per quorum (use its
  ``quorum.qid``), so that groups of different quorums never mix;
* ``dist.ProcessGroupGloo(prefixed_store, rank, size, datetime.timedelta(seconds=timeout_s))``:
  connects the ``size`` members; ``rank`` is this replica's place among them;
* ``pg.allreduce([tensor]).wait()`` sums ``tensor`` in place over the group.
"""

import datetime  # noqa: F401  (you will need it)

import torch  # noqa: F401
import torch.distributed as dist  # noqa: F401


def quorum_average(tensor, quorum, replica, store, timeout_s=5.0):
    """The mean of ``tensor`` over the members of ``quorum`` (a new tensor; leave ``tensor``
    as it is). ``replica``: this replica's id, one of ``quorum.members``;
    ``quorum.rank_of(replica)`` is its rank among them."""
    raise NotImplementedError("ch11.quorum_average: write me")
