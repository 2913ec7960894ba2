"""Reference for exercise ch06.interleaved (the engine's is engine/pp/schedules.py)."""


def interleaved_1f1b(p: int, m: int, v: int) -> dict[int, list[tuple]]:
    """Megatron-LM's interleaved 1F1B: warm-up forwards, one forward one backward, drain."""
    total = m * v

    def forward(k):  # the k-th forward of a rank: (micro-batch, chunk)
        return (k // (p * v)) * p + k % p, (k // p) % v

    def backward(k):  # the same groups of p, through the chunks in reverse
        return (k // (p * v)) * p + k % p, v - 1 - (k // p) % v

    schedule = {}
    for s in range(p):
        warmup = total if m == p else min(2 * (p - s - 1) + (v - 1) * p, total)
        actions = [("F", *forward(k)) for k in range(warmup)]
        for i in range(total - warmup):
            actions += [("F", *forward(warmup + i)), ("B", *backward(i))]
        actions += [("B", *backward(i)) for i in range(total - warmup, total)]
        schedule[s] = actions
    return schedule
