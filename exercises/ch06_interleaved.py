"""Exercise ch06.interleaved: the interleaved 1F1B order (Megatron-LM).

Each of the ``p`` pipeline ranks holds ``v`` model chunks: chunk ``c`` of rank ``s`` is
virtual stage ``c * p + s`` (Narayanan et al., "Efficient large-scale language model training
on GPU clusters using Megatron-LM", SC 2021, section 2.2). A micro-batch goes through all
``p * v`` virtual stages, so it visits every rank ``v`` times; the bubble shrinks ``v`` times.

Fill in ``interleaved_1f1b``, save, then run ``check("ch06.interleaved")`` in
course/06_pipeline.ipynb (or ``make grade``). It is checked on (p, m, v) you do not see with
:func:`engine.pp.validate` (every action once, no deadlock), :func:`engine.pp.simulate` (the
bubble must be (p-1)/(v m + p - 1)), and against the engine's order, Megatron-LM's.
"""


def interleaved_1f1b(p: int, m: int, v: int) -> dict[int, list[tuple]]:
    """``{stage: [("F", mb, chunk) or ("B", mb, chunk), ...]}`` for ``p`` stages, ``m``
    micro-batches (a multiple of ``p``) and ``v`` chunks per stage.

    * The order of forwards is the same on every rank: micro-batches go in groups of ``p``;
      a group goes through chunk 0, then chunk 1, ..., then the next group. So the k-th
      forward of a rank is micro-batch ``(k // (p v)) p + k % p`` on chunk ``(k // p) % v``.
    * Backwards go in the same groups, through the chunks in reverse: chunk
      ``v - 1 - (k // p) % v``.
    * Rank ``s`` runs ``2 (p - s - 1) + (v - 1) p`` warm-up forwards (all ``m v`` of them
      when ``m == p``, and never more than ``m v``), then one forward and one backward in
      turn, then the remaining backwards.
    """
    raise NotImplementedError("ch06.interleaved: write me")
