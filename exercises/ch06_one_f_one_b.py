"""Exercise ch06.one_f_one_b: write the 1F1B pipeline schedule.

Fill in ``one_f_one_b``, save, then run ``check("ch06.one_f_one_b")`` in
course/06_pipeline.ipynb (or ``make grade``). It is checked on (p, m) you do not see, including
fewer micro-batches than stages, with :func:`engine.pp.validate` (every action once, no
deadlock), :func:`engine.pp.simulate` (the bubble must be (p-1)/(m+p-1)) and the number of
micro-batches each stage holds at once.
"""


def one_f_one_b(p: int, m: int) -> dict[int, list[tuple]]:
    """The 1F1B schedule for ``p`` stages and ``m`` micro-batches: ``{stage: [("F", mb) or
    ("B", mb), ...]}``.

    Stage ``s`` first runs a few warm-up forwards (how many? the last stage needs none: it can
    start the backward of micro-batch 0 right after its forward), then alternates one forward
    and one backward, then runs the remaining backwards. Micro-batches go in order 0, 1, ...
    in both directions. Stage ``s`` must never hold more than ``p - s`` micro-batches whose
    forward ran and backward did not.
    """
    raise NotImplementedError("ch06.one_f_one_b: write me")
