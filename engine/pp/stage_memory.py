"""What one pipeline rank holds while it runs its schedule: the bytes kept for backward and
the micro-batches in flight, counted as the actions happen.

:func:`engine.pp.run_pipeline` feeds a :class:`StageMemory` once per action: after a forward
``F`` the activations autograd keeps (measured by :class:`engine.observe.memory.ActivationTracker`);
after a backward ``B`` those are freed, and in a schedule that splits the backward
(:mod:`engine.pp.zero_bubble`) what the deferred weight gradient needs is held instead, each
linear layer's input and output gradient (:mod:`engine.pp.weight_grad`); after ``W`` that is
freed too. Peaks are taken after every action, so they are the most the rank held at once.
"""

from __future__ import annotations

from engine.observe.memory import unique_storage_bytes


class StageMemory:
    """The counters of one rank's run; :meth:`counts` gives them as
    :class:`engine.pp.observers.PipelineRun`'s fields."""

    def __init__(self):
        self.activation_bytes: dict[int, int] = {}  # per chunk: one micro-batch's forward
        self.weight_stash_bytes: dict[int, int] = {}  # per chunk: one micro-batch, B to W
        self._activations: dict[tuple[int, int], int] = {}  # (mb, chunk) -> bytes, F to B
        self._stashes: dict[tuple[int, int], tuple[int, int]] = {}  # -> (bytes, grads), B to W
        self.held = self.in_flight = self.grads_held = self.pending = 0
        self.peak = self.peak_in_flight = self.peak_grads = self.peak_pending = 0

    def forward(self, mb: int, chunk: int, nbytes: int) -> None:
        """``F(mb, chunk)`` ran and left ``nbytes`` of activations for its backward."""
        self._activations[mb, chunk] = nbytes
        self.activation_bytes.setdefault(chunk, nbytes)
        self.held += nbytes
        self.in_flight, self.pending = self.in_flight + 1, self.pending + 1
        self._take_peaks()

    def backward(self, mb: int, chunk: int, stash=None) -> None:
        """``B(mb, chunk)`` ran and freed its activations; ``stash``: in a split backward,
        the ``(input, output gradient, ...)`` records its W still needs (None: a full
        backward, and the micro-batch is done)."""
        self.held -= self._activations.pop((mb, chunk))
        self.in_flight -= 1
        if stash is None:
            self.pending -= 1
        else:
            kept = unique_storage_bytes([t for inp, dy, *_ in stash for t in (inp, dy)])
            grads = unique_storage_bytes([dy for _, dy, *_ in stash])
            self._stashes[mb, chunk] = (kept, grads)
            self.weight_stash_bytes.setdefault(chunk, kept)
            self.held, self.grads_held = self.held + kept, self.grads_held + grads
        self._take_peaks()

    def weight_grad(self, mb: int, chunk: int) -> None:
        """``W(mb, chunk)`` ran: what its backward kept for it is freed."""
        kept, grads = self._stashes.pop((mb, chunk))
        self.held, self.grads_held = self.held - kept, self.grads_held - grads
        self.pending -= 1
        self._take_peaks()

    def _take_peaks(self) -> None:
        self.peak = max(self.peak, self.held)
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        self.peak_grads = max(self.peak_grads, self.grads_held)
        self.peak_pending = max(self.peak_pending, self.pending)

    def counts(self) -> dict:
        """The counters under :class:`engine.pp.observers.PipelineRun`'s field names."""
        return {"peak_activation_bytes": self.peak, "activation_bytes": self.activation_bytes,
                "peak_in_flight": self.peak_in_flight,
                "weight_stash_bytes": self.weight_stash_bytes,
                "peak_grad_stash_bytes": self.peak_grads, "peak_held": self.peak_pending}
