"""DiLoCo and streaming DiLoCo: H local steps, then an outer Nesterov step on the average of the
replicas' pseudo-gradients.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (2023),
Algorithm 1. Each replica starts an outer step from the same parameters ``θ``, takes ``H``
inner steps of its own optimizer (AdamW in the paper) on its own data and ends at ``θ_i``. The
*pseudo-gradient* ``Δ_i = θ - θ_i`` is averaged over the replicas (one all-reduce every ``H``
steps, against one per step for data parallelism), and an outer SGD with Nesterov momentum
applies it to ``θ``::

    Δ = mean_i (θ - θ_i);  m = μ m + Δ;  θ <- θ - η (Δ + μ m)     (Nesterov; θ - η m without)

Every replica then continues from the new ``θ``. With ``H = 1``, an inner SGD, ``η = 1`` and
``μ = 0`` this is data parallelism: ``θ - mean_i (θ - (θ - lr g_i)) = θ - lr mean_i g_i``.

**Streaming DiLoCo** (Douillard et al., "Streaming DiLoCo with overlapping communication:
towards a distributed free lunch", 2025) cuts the model into ``fragments`` of whole layers and
syncs them at staggered steps. The paper prefers *strided* fragments (layer ``i`` in fragment
``i mod F``) to consecutive runs of layers; :func:`split_fragments` cuts consecutive runs, and
``fragments`` given as modules (:func:`module_fragments`) can make any cut, strided too.
Fragment ``p`` syncs at the steps ``t`` with ``t ≡ (p+1)·H/F (mod H)``, so each fragment
still syncs every ``H`` steps but only ``1/F`` of the model crosses the link at once: the peak
bandwidth falls by ``F``. With an overlap
``delay = τ`` the all-reduce is started at step ``t`` and its result applied at ``t + τ``
while the inner steps go on; the fragment is then merged, ``θ_local <- α θ_local + (1-α) θ``
(``mix = α``; the paper uses α = 0.5 with overlap; 0, the default, is a plain replace).
``outer_dtype=torch.bfloat16`` all-reduces the pseudo-gradients in bf16 (half the bytes); the
outer step stays in fp32.

Bytes: each sync of a fragment of ``P_f`` elements is one ring all-reduce,
``2(n-1)/n · P_f · b`` per rank (:func:`engine.theory.diloco_bytes`), counted by
:class:`engine.observe.meter.CommMeter` since it goes through :mod:`engine.comm.ops`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import ops
from engine.validation import fraction, non_negative_int, non_negative_number, positive_int


def model_layers(model: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """The modules that own trainable parameters directly, in model order, each with the
    parameters it is the first to own (a tied weight belongs to its first owner only): the
    units a fragment is made of."""
    seen: set[nn.Parameter] = set()
    layers = []
    for module in model.modules():
        mine = [p for p in module.parameters(recurse=False) if p.requires_grad and p not in seen]
        seen.update(mine)
        if mine:
            layers.append((module, mine))
    return layers


def split_fragments(model: nn.Module, fragments: int) -> list[list[nn.Parameter]]:
    """The model's parameters in ``fragments`` groups of consecutive layers, equal in count
    (not the paper's strided cut, layer ``i`` in fragment ``i mod F``: the two agree only when
    every fragment is one layer).

    A ValueError names both numbers when ``fragments`` does not divide the layers."""
    positive_int("fragments", fragments)
    layers = model_layers(model)
    if not layers:
        raise ValueError("the model has no trainable parameters to synchronize")
    if len(layers) % fragments:
        raise ValueError(f"fragments = {fragments} must divide the model's {len(layers)} layers "
                         f"(modules owning parameters: "
                         f"{', '.join(type(m).__name__ for m, _ in layers)})")
    per = len(layers) // fragments
    return [[p for _, params in layers[i * per:(i + 1) * per] for p in params]
            for i in range(fragments)]


def module_fragments(model: nn.Module, parts) -> list[list[nn.Parameter]]:
    """The fragments given as modules (torchft's ``model_fragments``: e.g. a transformer's
    blocks, the embeddings with the first): each fragment's trainable parameters, a tied
    weight in its first fragment only. A ValueError names what is wrong when a part is not in
    ``model``, owns no parameter of its own, or a parameter of the model is in no part."""
    owned = {id(p) for p in model.parameters() if p.requires_grad}
    seen: set[int] = set()
    split = []
    for index, part in enumerate(parts):
        mine = [p for p in part.parameters() if p.requires_grad and id(p) not in seen]
        if any(id(p) not in owned for p in mine):
            raise ValueError(f"fragment {index} ({type(part).__name__}) holds parameters that "
                             "are not the model's")
        if not mine:
            raise ValueError(f"fragment {index} ({type(part).__name__}) has no trainable "
                             "parameter of its own")
        seen.update(id(p) for p in mine)
        split.append(mine)
    missing = [name for name, p in model.named_parameters() if p.requires_grad
               and id(p) not in seen]
    if missing:
        raise ValueError(f"the fragments leave {len(missing)} of the model's parameters out "
                         f"(first: {missing[0]}); every parameter must be in one fragment")
    return split


@dataclass
class Sync:
    """One fragment's sync: started after inner step ``step``, applied after ``applied``."""

    step: int
    fragment: int
    numel: int
    wire_dtype: torch.dtype
    applied: int | None = None


class Fragment:
    """A group of parameters with its outer state: the start point ``θ`` (fp32, flat) and an
    outer SGD (Nesterov) over it."""

    def __init__(self, params: list[nn.Parameter], index: int, lr: float, momentum: float,
                 nesterov: bool):
        self.params, self.index = params, index
        self.start = nn.Parameter(self.flat_local().float().clone())
        self.outer = torch.optim.SGD([self.start], lr=lr, momentum=momentum,
                                     nesterov=nesterov and momentum > 0)
        self.pending = None  # (work, buffer, sync) while an overlapped all-reduce is in flight

    def flat_local(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def set_local(self, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()


class DiLoCo:
    """Call :meth:`step` after every inner optimizer step.

    Args:
        model: this replica's model (the same initial parameters on every replica: the
            constructor broadcasts them from the group's first rank).
        inner_optimizer: the replica's own optimizer (AdamW in the paper); DiLoCo never
            touches its state.
        sync_every: H, the inner steps between two syncs of a fragment (>= 1).
        outer_lr, outer_momentum, nesterov: the outer SGD (the paper: 0.7, 0.9, Nesterov).
        fragments: F, streaming DiLoCo's number of fragments (must divide the layers), or
            the fragments themselves as a list of modules (:func:`module_fragments`).
        delay: τ, the inner steps an outer all-reduce overlaps with (0 <= τ < H/F when F > 1,
            τ < H when F = 1).
        mix: α, the weight of the local parameters when an overlapped result is merged.
        outer_dtype: the dtype of the all-reduced pseudo-gradient (e.g. ``torch.bfloat16``);
            default the parameters' fp32.
        group: the replicas' process group (default: the world).
    """

    def __init__(self, model: nn.Module, inner_optimizer, sync_every: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, fragments: int = 1,
                 delay: int = 0, mix: float = 0.0, outer_dtype: torch.dtype | None = None,
                 group=None):
        parts = None if isinstance(fragments, int) else list(fragments)
        if parts is not None:
            fragments = len(parts)
        positive_int("sync_every (H, the inner steps between syncs)", sync_every)
        non_negative_number("outer_lr", outer_lr)
        fraction("outer_momentum", outer_momentum, open_low=False)
        non_negative_int("delay (τ, the inner steps a sync overlaps with)", delay)
        fraction("mix (α, the local weight of a merge)", mix, open_low=False)
        positive_int("fragments", fragments)
        stagger = max(sync_every // fragments, 1)
        if sync_every % fragments:
            raise ValueError(f"fragments = {fragments} must divide sync_every = {sync_every} "
                             "so that the fragments sync at evenly staggered steps")
        if delay >= stagger:
            raise ValueError(f"delay = {delay} must be below sync_every / fragments = {stagger}: "
                             "a fragment's sync must land before the next one starts")
        split = split_fragments(model, fragments) if parts is None else \
            module_fragments(model, parts)  # a bad count fails before any traffic
        self.model, self.inner, self.group = model, inner_optimizer, group
        self.sync_every, self.delay, self.mix = sync_every, delay, mix
        self.outer_dtype = outer_dtype
        self.replicas = dist.get_world_size(group)
        root = ops.group_ranks(group)[0]
        with torch.no_grad():
            for p in model.parameters():
                ops.broadcast(p.data, root, group)
        self.fragments = [Fragment(params, i, outer_lr, outer_momentum, nesterov)
                          for i, params in enumerate(split)]
        self.offsets = [(i + 1) * stagger % sync_every for i in range(fragments)]
        self.steps = 0
        self.syncs: list[Sync] = []

    def due(self, step: int) -> list[int]:
        """The fragments whose sync starts after inner step ``step`` (1-based)."""
        return [i for i, offset in enumerate(self.offsets) if step % self.sync_every == offset]

    @torch.no_grad()
    def step(self) -> list[int]:
        """Count one inner step; start the syncs that are due, apply those that have landed.
        Returns the fragments whose outer step was applied now."""
        self.steps += 1
        for i in self.due(self.steps):
            self._start_sync(self.fragments[i])
        applied = []
        for fragment in self.fragments:
            if fragment.pending is not None and fragment.pending[2].step + self.delay == self.steps:
                self._apply(fragment)
                applied.append(fragment.index)
        return applied

    def _start_sync(self, fragment: Fragment) -> None:
        pseudo = fragment.start.detach() - fragment.flat_local().float()
        wire = pseudo if self.outer_dtype is None else pseudo.to(self.outer_dtype)
        sync = Sync(self.steps, fragment.index, wire.numel(), wire.dtype)
        work = ops.all_reduce(wire, group=self.group, async_op=self.delay > 0)
        fragment.pending = (work, wire, sync)
        self.syncs.append(sync)

    def _apply(self, fragment: Fragment) -> None:
        work, wire, sync = fragment.pending
        if work is not None:
            work.wait()
        fragment.start.grad = wire.float().div_(self.replicas)
        fragment.outer.step()
        fragment.start.grad, fragment.pending = None, None
        merged = fragment.start.detach()
        if self.mix:
            merged = self.mix * fragment.flat_local().float() + (1 - self.mix) * merged
        fragment.set_local(merged)
        sync.applied = self.steps

    def finish(self) -> None:
        """Wait for and apply any sync still in flight (at the end of training)."""
        for fragment in self.fragments:
            if fragment.pending is not None:
                self._apply(fragment)
