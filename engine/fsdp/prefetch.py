"""When a group's all-gather starts early: PyTorch FSDP's prefetches, in forward and backward.

**Forward.** A model's forwards run its groups in the same order every time. So when the
root's forward starts, and after each group's gather while the order still follows the last
forward's, :class:`Prefetch` starts the all-gather of the group that ran next last time
(``group.prefetched``): it travels while this group computes, and that group's forward only
waits for what is left of it (FSDP1's ``forward_prefetch=True``;
FSDP2 gets the same on GPUs by issuing its all-gathers on a stream of their own ahead of the
compute, or explicitly with ``set_modules_to_forward_prefetch``). A forward that leaves the
order prefetches nothing more; a prefetch no forward took (a forward that raised) is waited
for and dropped when the next forward starts, as its values may be stale by then.

**Backward** visits the groups in the reverse of the order their forwards ran. So when
backward reaches a group (its pre-backward gathers it), the group whose backward comes next is
the one whose forward ran just before it: its all-gather starts then
(:meth:`engine.fsdp.gathered.Gathered.prefetch`), so it travels while this group's backward
computes (FSDP1's ``BackwardPrefetch.BACKWARD_PRE``; FSDP2 does the same by default, Zhao et
al., "PyTorch FSDP", VLDB 2023, section 4.2).

Either way at most two groups besides the root are whole at once. The root keeps its
parameters through the step and is never prefetched; a pipeline step
(:mod:`engine.fsdp.step`) gathers on its own schedule and is left alone.
"""

from __future__ import annotations

from engine.fsdp import comm


class Prefetch:
    """The order this forward and the last one ran the groups in; the next group's gather,
    in forward and in backward."""

    def __init__(self):
        self.order: list = []  # the groups this forward ran (those it frees after it)
        self.last_order: list = []  # the forward's before
        self.on_track = False  # this forward has run the last one's groups so far
        self.started: list = []  # the groups whose forward gather started early

    def ran_forward(self, group) -> None:
        if group.is_root:  # a forward from the root: a new order
            for early in self.started:  # what the forward before did not take
                _drop_forward_gather(early)
            self.started = []
            self.last_order, self.order, self.on_track = self.order, [], True
        elif group.reshard_after_forward:
            at = len(self.order)
            self.on_track = self.on_track and at < len(self.last_order) and \
                self.last_order[at] is group
            self.order.append(group)
        else:
            return
        at = len(self.order)
        if self.on_track and at < len(self.last_order):
            following = self.last_order[at]
            if _start_forward_gather(following):
                self.started.append(following)

    def backward_reached(self, group) -> None:
        if group not in self.order:
            return
        at = len(self.order) - 1 - self.order[::-1].index(group)
        if at > 0 and self.order[at - 1].last is not None:
            self.order[at - 1].last.prefetch()


def _start_forward_gather(group) -> bool:
    """Start the all-gather of ``group``'s coming forward, its bytes counted from now;
    :class:`engine.fsdp.group.Unshard` takes it (``group.prefetched``). Whether it started."""
    if group.prefetched is not None or group.backward is not None or group.step is not None:
        return False
    group.prefetched = comm.Gathering(group.columns, group.gather_dtype, group.group,
                                      async_op=True)
    group.observe(group.nbytes)
    return True


def _drop_forward_gather(group) -> None:
    """A forward all-gather started early that no forward took: waited for, dropped."""
    if group.prefetched is not None:
        group.prefetched.wait()
        group.prefetched = None
        group.observe(-group.nbytes)
