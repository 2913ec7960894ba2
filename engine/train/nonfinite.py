"""A loss that is not finite stops the run, naming the step and where the first non-finite
value appeared: the rank and the layer.

Once a loss is ``nan`` or ``inf`` (a learning rate far too high, an overflow, bad data) the
run does not recover: AdamW spreads one non-finite gradient into every parameter it updates,
and every later loss is ``nan``. So ``engine train`` checks each step's loss and stops every
rank at the first that is not finite, before that step is saved, with one line
(:class:`NonFiniteLoss`)::

    step 2 of 4: the loss is nan, not finite; replayed with a forward hook on every layer,
    the first non-finite value came out of layer tok (Embedding) on rank 0 (ranks 0, 1 saw
    one), where 30 of 30 parameter tensors are no longer finite after the step's update; ...

How, cheaply (:class:`NonFiniteWatch`):

* **the trigger** is the loss, a Python float every rank already holds (the global loss, the
  same on every rank: :func:`engine.compose.loop.train_step`), tested with ``math.isfinite``
  and nothing more: a healthy step runs no hook and reads nothing, and every rank decides
  alike at the same step, so none waits on another. (A forward hook on every leaf layer
  costs more than it seems: measured on the CPU, 16% of a ``tiny`` step and 20% of a
  ``small`` one; on the transformer blocks alone still 5-9%.)
* **the location**, on the failing step only: every rank arms a forward hook on each of the
  model's leaf modules (those without children: linear layers, norms, embeddings), which
  notes per call whether its output is finite, and runs that step again (the same call on
  every rank, so its collectives match); each rank takes the first module, in call order,
  whose output held a non-finite value, and counts its parameter tensors that are no longer
  finite; the ranks gather theirs (one ``all_gather_object``) and the line names the lowest
  rank that saw one, its layer, and that count. A hook fires when its module returns, so
  the first flagged leaf is the first place a non-finite value came out of; code between
  leaves (attention's softmax, a residual add) shows up in the next leaf that reads its
  result.

The replay runs on the parameters the failing step left. When its update made them
non-finite (a ``nan`` loss has ``nan`` gradients), the first layer that uses them is the one
named, and the count says so; finding where a healthy model first overflowed needs the
parameters from before that step: a diagnosis replays from the last checkpoint with
:func:`first_nonfinite`, the same search for one model and one input, outside a run. No
output flagged while the loss is not finite means the loss itself overflowed (its sum over
the tokens, or the cross-entropy of huge logits), and the line says so.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

# what wrappers put in module names (DDP and FSDP's ``module.``, FSDP's and activation
# checkpointing's inner names): dropped, so the layer reads as the model names it
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


class NonFiniteLoss(RuntimeError):
    """The loss of a step is not finite; the message names the step and the first rank and
    layer where a non-finite value appeared (raised on every rank, with the same message)."""

    def __init__(self, message: str, step: int, rank: int | None, layer: str | None):
        super().__init__(message)
        self.step, self.rank, self.layer = step, rank, layer


def layer_name(name: str) -> str:
    """``name`` (from ``named_modules``) without what DDP, FSDP and checkpoint wrappers add."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name[len("module."):] if name.startswith("module.") else name


class NonFiniteWatch:
    """The check of each step's loss, and the search for where a non-finite value came from
    (module docstring). No hook on a healthy step: ``check(step, loss)`` returns when the
    loss is finite. When it is not, :meth:`arm` puts a forward hook on every leaf module of
    ``model`` (each call notes whether its output is finite), ``replay()`` runs the failing
    step again on every rank, the ranks gather their first flagged layer and the number of
    their parameter tensors that are no longer finite, the hooks come off, and every rank
    raises the same :class:`NonFiniteLoss`. Call ``check`` on every rank at the same step
    (it gathers over the world when a process group exists). :meth:`arm` and
    :meth:`first_here` also serve a search outside a run (:func:`first_nonfinite`)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.notes: list[tuple[str, str, torch.Tensor]] = []
        self.handles = []

    def arm(self) -> NonFiniteWatch:
        """Hooks on every leaf module: from now on each call notes whether its output is
        finite (in call order)."""
        if not self.handles:
            for name, module in self.model.named_modules():
                if next(module.children(), None) is None:
                    self.handles.append(module.register_forward_hook(
                        self._hook(layer_name(name) or type(module).__name__,
                                   type(module).__name__)))
        return self

    def _hook(self, name: str, kind: str):
        def note(module, inputs, output) -> None:
            for tensor in _floating(output):
                self.notes.append((name, kind, torch.isfinite(tensor.detach()).all()))
        return note

    def first_here(self) -> tuple[str, str] | None:
        """This rank's first module, in call order since it was armed, whose output held a
        non-finite value: ``(name, type)``, or None."""
        for name, kind, finite in self.notes:
            if not bool(finite):
                return name, kind
        return None

    def nonfinite_parameters(self) -> tuple[int, int]:
        """How many of this rank's parameter tensors hold a non-finite value, of how many."""
        params = list(self.model.parameters())
        return sum(not bool(torch.isfinite(p.detach()).all()) for p in params), len(params)

    def check(self, step: int, loss: float, total: int | None = None, advice: str = "",
              replay: Callable[[], object] | None = None) -> None:
        """After step ``step`` (numbered from 1; ``total``: the run's steps): return if
        ``loss`` is finite, else search (``replay``: the failing step again, the same call on
        every rank; None: what the hooks noted since :meth:`arm`) and raise
        :class:`NonFiniteLoss` on every rank. ``advice``: what the line ends with."""
        if math.isfinite(loss):
            return
        try:
            if replay is not None:
                self.arm()
                self.notes.clear()
                replay()
            mine = (self.first_here(), *self.nonfinite_parameters())
        finally:
            self.remove()
        found = [(0, mine)]
        if dist.is_available() and dist.is_initialized():
            found = [None] * dist.get_world_size()
            dist.all_gather_object(found, (dist.get_rank(), mine))
        seen = sorted((rank, where) for rank, where in found if where[0] is not None)
        of = f" of {total}" if total is not None else ""
        head = f"step {step}{of}: the loss is {loss}, not finite"
        again = "replayed with a forward hook on every layer, " if replay is not None else ""
        if seen:
            rank, ((name, kind), bad, count) = seen[0]
            ranks = [r for r, _ in seen]
            where = (f"; {again}the first non-finite value came out of layer {name} ({kind}) "
                     f"on rank {rank}"
                     + (f" (ranks {', '.join(map(str, ranks))} saw one)" if len(ranks) > 1
                        else "")
                     + (f", where {bad} of {count} parameter tensors are no longer finite "
                        "after the step's update" if bad else ""))
        else:
            rank = name = None
            where = (f"; {again}no layer's output held a non-finite value on any rank: the "
                     "loss itself overflowed (its sum over the tokens, or the cross-entropy "
                     "of huge logits)")
        raise NonFiniteLoss(head + where + (f"; {advice}" if advice else ""), step, rank,
                            name)

    def remove(self) -> None:
        """Take the hooks off and drop the notes."""
        for handle in self.handles:
            handle.remove()
        self.handles, self.notes = [], []

    def __enter__(self) -> NonFiniteWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def first_nonfinite(model: nn.Module, *inputs, **kwargs) -> tuple[str, str] | None:
    """Run ``model(*inputs, **kwargs)`` (no gradients) and return the first leaf module, in
    call order, whose output held a non-finite value: ``(name, type)``, or None. One
    process, no collective."""
    with NonFiniteWatch(model).arm() as watch, torch.no_grad():
        model(*inputs, **kwargs)
        return watch.first_here()


def _floating(output: Any):
    """The floating-point tensors in a module's output (a tensor, or tuples, lists and dicts
    of them)."""
    if isinstance(output, torch.Tensor):
        if output.is_floating_point() or output.is_complex():
            yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _floating(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _floating(item)
