"""The whole parameters of one ``fully_shard`` group, gathered into tensors that autograd may
save and freed without letting autograd see a change.

A :class:`Gathered` is made once per forward call (or per pipeline step) by
:class:`engine.fsdp.group.Unshard`: one tensor per parameter, its full shape, in the group's
``gather_dtype``. :meth:`Gathered.free` resizes their storage to 0 bytes (autograd keeps the
tensors, not their bytes); :meth:`Gathered.refill` allocates the bytes again and all-gathers
into them (:func:`engine.fsdp.comm.all_gather`): the same tensors, the same values, so the
version counters autograd checks are kept. The group's ``observer`` is told each (+ and -).
"""

from __future__ import annotations

import torch

from engine.fsdp import comm


class Gathered:
    """The whole parameters of one forward call (or one pipeline step), freed and filled
    again as backward needs."""

    def __init__(self, group, gather: bool):
        self.group, self.freed, self.pending = group, True, None
        self.tensors = [torch.empty(p.layout.shape, dtype=group.gather_dtype,
                                    device=p.shard.device) for p in group.params]
        self.nbytes = group.nbytes
        # the all-gather's copy-out targets, seen once (views stay valid across resizes)
        self.rows = group.columns.rows_of(self.tensors) if group.columns.even else None
        if gather:
            if group.prefetched is not None:  # its forward's gather started early: counted
                self.pending, group.prefetched, self.freed = group.prefetched, None, False
            self.refill()
        else:  # empty until its first use
            self._resize(0)

    def aliases(self) -> tuple[torch.Tensor, ...]:
        """What :class:`engine.fsdp.group.Unshard` returns: each tensor's alias (``detach``:
        the same storage and version counter), which autograd points at its node. Were the
        tensors themselves returned, node -> this -> tensors -> node would be a cycle Python's
        collector cannot see through (a tensor's node is not traversed): every forward's
        ``Gathered`` would live for good."""
        aliases = tuple(t.detach() for t in self.tensors)
        for alias, p in zip(aliases, self.group.params):
            alias.fsdp_param = p  # a deferred weight gradient (W) finds its shard by it
        return aliases

    def _resize(self, full: int) -> None:
        for t in self.tensors:
            t.untyped_storage().resize_(full * t.numel() * t.element_size())

    def free(self) -> None:
        if not self.freed and not self.group.held:
            if self.pending is not None:  # prefetched, but its backward never came
                self.pending.wait()
                self.pending = None
            self._resize(0)
            self.freed = True
            self.group.observe(-self.nbytes)

    def prefetch(self) -> None:
        """Start filling the tensors: the all-gather in flight, while other work runs;
        :meth:`refill` finishes it (:mod:`engine.fsdp.prefetch` decides when)."""
        if self.freed:
            self._start(async_op=True)

    def _start(self, async_op: bool) -> None:
        self._resize(1)
        self.pending = comm.Gathering(self.group.columns, self.group.gather_dtype,
                                      self.group.group, async_op=async_op)
        self.freed = False
        self.group.observe(self.nbytes)

    def refill(self) -> None:
        if self.freed:
            self._start(async_op=False)
        if self.pending is not None:
            # autograd saved these tensors: new bytes, the same values, not a modification
            with torch.no_grad(), \
                    torch.autograd._unsafe_preserve_version_counter(tuple(self.tensors)):
                self.pending.finish(self.tensors, self.rows)
            self.pending = None
