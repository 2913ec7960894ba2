"""Solution of ch11.quorum_average: a Gloo group over the quorum's members only, built over
the shared store under the quorum's id; sum, then divide by the members (engine.ft.group)."""

import datetime

import torch.distributed as dist


def quorum_average(tensor, quorum, replica, store, timeout_s=5.0):
    prefixed = dist.PrefixStore(f"quorum/{quorum.qid}/", store)
    pg = dist.ProcessGroupGloo(prefixed, quorum.rank_of(replica), len(quorum.members),
                               datetime.timedelta(seconds=timeout_s))
    out = tensor.detach().clone()
    pg.allreduce([out]).wait()
    return out.div_(len(quorum.members))
