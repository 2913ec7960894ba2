"""When a group's all-gather starts early: PyTorch FSDP2's backward prefetch.

Backward visits the groups in the reverse of the order their forwards ran. So when backward
reaches a group (its pre-backward gathers it), the group whose backward comes next is the one
whose forward ran just before it: :class:`BackwardPrefetch` starts that group's all-gather
then (:meth:`engine.fsdp.gathered.Gathered.prefetch`), so it travels while this group's
backward computes, and that group's pre-backward only waits for what is left of it (FSDP1's
``BackwardPrefetch.BACKWARD_PRE``; FSDP2 does the same by default, Zhao et al., "PyTorch
FSDP", VLDB 2023, section 4.2). At most two groups are whole at once. The root keeps its
parameters through the step and is never prefetched; a pipeline step
(:mod:`engine.fsdp.step`) gathers on its own schedule and is left alone.
"""

from __future__ import annotations


class BackwardPrefetch:
    """The order the last forward ran the groups in; in backward, the next group's gather."""

    def __init__(self):
        self.order: list = []

    def ran_forward(self, group) -> None:
        if group.is_root:  # a forward from the root: a new order
            self.order = []
        elif group.reshard_after_forward:
            self.order.append(group)

    def backward_reached(self, group) -> None:
        if group not in self.order:
            return
        at = len(self.order) - 1 - self.order[::-1].index(group)
        if at > 0 and self.order[at - 1].last is not None:
            self.order[at - 1].last.prefetch()
