"""Zero-bubble pipeline schedules: the backward split into B (input gradient) and W (weight
gradient), and W moved into the bubble.

* :func:`zb_h1` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 2.1,
  Figure 3): 1F1B's order with every B the input gradient only and stage ``s``'s W's starting
  ``s`` backwards late, so that every stage holds ``p`` micro-batches between F and W, as
  stage 0 of 1F1B does. Idle time per stage ``(p-1)(T_F + T_B - T_W)`` instead of 1F1B's
  ``(p-1)(T_F + T_B + T_W)`` (exact when ``m >= p`` and ``T_W <= T_F, T_B``;
  :func:`engine.theory.zb_h1_bubble_time`).
* :func:`zb_h2` (the same paper, section 2.2, "Zero bubble schedule", Figure 3 below ZB-H1,
  and its table of bubble and peak memory per schedule): stage ``s`` fills its
  warm-up with ``2(p-s)-1`` forwards (up to the first B's arrival) and runs each W ``2s``
  backwards late, so the W's fill the tail and the shape of the step is a parallelogram:
  idle time ``(p-1)(T_F + T_B - 2T_W)`` within each stage's own span, zero when
  ``T_F = T_B = T_W`` (exact when ``m >= 2p-1`` and ``T_W <= T_F, T_B``;
  :func:`engine.theory.zb_h2_bubble_time`), for ``2p-1`` micro-batches held on every stage
  (the paper's ``(2p-1) M_B``). Zero bubble across steps needs the optimizer step not to
  wait for the other stages (section 4, post-validation: :mod:`engine.pp.post_validation`).
* :func:`zb_v` (the same paper, section 6, "ZB-V"): two chunks per rank placed in a V
  (``placement="v"``: rank 0 holds virtual stages 0 and ``2p-1``); the hand-crafted order of
  the authors' repository (sail-sg/zero-bubble-pipeline-parallelism, ``get_zb_v_schedule``).
* :func:`dualpipe_v` (deepseek-ai/DualPipe, ``DualPipeV``: the DeepSeek-V3 technical report,
  2024, describes DualPipe, two copies of the model fed from both ends; DualPipeV is its
  "cut-in-half" form, proposed by Sea AI Lab and added to the DualPipe repository in 2025):
  one copy of the model on a V: the same two chunks per rank as ZB-V, and a steady
  phase in which the forward of one chunk is paired with the full backward of the other (on
  a GPU the pair overlaps one's communication with the other's compute).

Run them with ``placement="v"`` for the last two. A full (unsplit) backward is written as its
B followed at once by its W: the same work, and the input gradient leaves one W earlier.
"""

from __future__ import annotations

from collections import deque

from engine.pp.actions import Action
from engine.pp.schedules import check_sizes


def zb_h1(p: int, m: int) -> dict[int, list[Action]]:
    """ZB-H1: stage ``s`` runs ``min(p-s-1, m)`` warm-up forwards, then one forward and one
    input gradient B in turn, then the remaining B's; each B's W follows ``s`` B's later."""
    check_sizes(p, m)
    schedule = {}
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions = [Action("F", i) for i in range(warmup)]
        for b in range(m):
            if warmup + b < m:
                actions.append(Action("F", warmup + b))
            actions.append(Action("B", b))
            if b >= s:
                actions.append(Action("W", b - s))
        actions += [Action("W", w) for w in range(max(m - s, 0), m)]
        schedule[s] = actions
    return schedule


def zb_h2(p: int, m: int) -> dict[int, list[Action]]:
    """ZB-H2: stage ``s`` runs ``min(2(p-s)-1, m)`` warm-up forwards, then for each
    micro-batch its B, the W of the B ``2s`` earlier, and the next forward; the ``2s`` W's
    left run at the end. With ``T_F = T_B = T_W`` every stage is busy from its first forward
    to its last W (needs ``m >= 2p-1``; with fewer micro-batches the warm-up cannot fill)."""
    check_sizes(p, m)
    schedule = {}
    for s in range(p):
        warmup = min(2 * (p - s) - 1, m)
        actions = [Action("F", i) for i in range(warmup)]
        w = 0
        for b in range(m):
            actions.append(Action("B", b))
            if b + 1 - w > 2 * s:  # W runs 2s backwards behind its B
                actions.append(Action("W", w))
                w += 1
            if warmup + b < m:
                actions.append(Action("F", warmup + b))
        actions += [Action("W", i) for i in range(w, m)]
        schedule[s] = actions
    return schedule


class _Order:
    """One rank's order being built: the next micro-batch of each (kind, chunk), and the W's
    whose B ran but which are left for later."""

    def __init__(self):
        self.actions: list[Action] = []
        self.next: dict[tuple[str, int], int] = {}
        self.deferred: deque[Action] = deque()

    def count(self, kind: str, chunk: int) -> int:
        return self.next.get((kind, chunk), 0)

    def add(self, kind: str, chunk: int) -> Action:
        """The next micro-batch's ``kind`` on ``chunk``."""
        mb = self.count(kind, chunk)
        self.next[kind, chunk] = mb + 1
        self.actions.append(Action(kind, mb, chunk))
        return self.actions[-1]

    def input_grad(self, chunk: int) -> None:
        """B now, its W later (:meth:`weight_grad`)."""
        self.deferred.append(Action("W", self.add("B", chunk).mb, chunk))

    def full_backward(self, chunk: int) -> None:
        """B and its W at once: the whole backward."""
        self.actions.append(Action("W", self.add("B", chunk).mb, chunk))

    def weight_grad(self, chunk: int | None = None) -> None:
        """The oldest deferred W (of ``chunk``, if given), if there is one."""
        for w in self.deferred:
            if chunk is None or w.chunk == chunk:
                self.deferred.remove(w)
                self.actions.append(w)
                return

    def weight_grads(self, chunk: int) -> None:
        """Every deferred W of ``chunk``, oldest first."""
        while any(w.chunk == chunk for w in self.deferred):
            self.weight_grad(chunk)


def zb_v(p: int, m: int) -> dict[int, list[Action]]:
    """ZB-V on ``p`` ranks, two chunks each, V placement. Built for ``max(m, 2p-1)``
    micro-batches, the fewest that fill the V, then the extra ones dropped, as the authors'
    ``get_zb_v_schedule`` does."""
    check_sizes(p, m)
    n = max(2 * p - 1, m)
    schedule = {}
    for s in range(p):
        order = _Order()
        for _ in range(2 * (p - s) - 1):  # warm-up: chunk 0 fills the way down the V
            order.add("F", 0)
        for _ in range(s):
            order.add("F", 1), order.add("F", 0)
        for _ in range(p - s):  # chunk 1 starts back up; its backward follows at once
            order.add("F", 1), order.full_backward(1)
        while order.count("F", 1) < order.count("F", 0) or order.count("F", 0) < n:  # steady
            if order.count("F", 0) < n:
                order.add("F", 0)
            order.full_backward(0)
            order.add("F", 1), order.full_backward(1)
        for _ in range(s):  # cool-down: input gradients first, their W's fill in after
            order.input_grad(0), order.input_grad(1)
        for _ in range(p - s):
            order.input_grad(0), order.weight_grad(0)
        order.weight_grads(1), order.weight_grads(0)
        schedule[s] = [a for a in order.actions if a.mb < m]
    return schedule


def dualpipe_v(p: int, m: int) -> dict[int, list[Action]]:
    """DualPipeV on ``p`` ranks, two chunks each, V placement; needs ``m >= 2p``. The eight
    steps of DeepSeek's ``DualPipeV.step`` for rank ``s``: forwards of chunk 0, then of both
    chunks; chunk 1's first backwards as B with a deferred W; the steady phase of paired
    (F of one chunk, full backward of the other); the tail, where backwards switch to B with
    deferred W's half-way, which then fill the end."""
    check_sizes(p, m)
    if m < 2 * p:
        raise ValueError(f"DualPipeV needs m (micro-batches) >= 2p = {2 * p}, got m={m}")
    schedule = {}
    for s in range(p):
        order = _Order()
        for _ in range(2 * (p - s - 1)):  # 1: chunk 0 forwards
            order.add("F", 0)
        for _ in range(s + 1):  # 2: both chunks
            order.add("F", 0), order.add("F", 1)
        for _ in range(p - s - 1):  # 3: B1, a W, F1 (zero bubble)
            order.input_grad(1), order.weight_grad(), order.add("F", 1)
        for _ in range(m - 2 * p + s + 1):  # 4: (F0, full B1), (F1, full B0)
            order.add("F", 0), order.full_backward(1)
            order.add("F", 1), order.full_backward(0)
        for _ in range(p - s - 1):  # 5: full B1, (F1, full B0)
            order.full_backward(1)
            order.add("F", 1), order.full_backward(0)
        split = False
        for i in range(s + 1):  # 6: B1, B0; from half-way on, W deferred
            if i == (s + 1) // 2 and s % 2 == 1:
                split = True
            order.input_grad(1) if split else order.full_backward(1)
            if i == (s + 1) // 2 and s % 2 == 0:
                split = True
            order.input_grad(0) if split else order.full_backward(0)
        for _ in range(p - s - 1):  # 7: a W, B0
            order.weight_grad(), order.input_grad(0)
        for _ in range(s + 1):  # 8: the last W's
            order.weight_grad()
        schedule[s] = order.actions
    return schedule
