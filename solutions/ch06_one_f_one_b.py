"""Reference for exercise ch06.one_f_one_b: the 1F1B schedule (PipeDream-Flush, Narayanan et
al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021), generated here."""


def one_f_one_b(p: int, m: int) -> dict[int, list[tuple]]:
    """The 1F1B schedule for ``p`` stages and ``m`` micro-batches: ``{stage: [("F", mb) or
    ("B", mb), ...]}``.

    Stage ``s`` runs ``min(p - s - 1, m)`` warm-up forwards (the last stage none), then one
    forward and one backward in turn while forwards remain, then the backwards it still owes.
    It never holds more than ``p - s`` micro-batches, and its bubble is GPipe's:
    (p-1)/(m+p-1) of the time.
    """
    schedule = {}
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions = [("F", i) for i in range(warmup)]
        forward, backward = warmup, 0
        while forward < m:
            actions += [("F", forward), ("B", backward)]
            forward, backward = forward + 1, backward + 1
        actions += [("B", i) for i in range(backward, m)]
        schedule[s] = actions
    return schedule
