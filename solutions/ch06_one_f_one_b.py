"""Reference for exercise ch06.one_f_one_b."""


def one_f_one_b(p: int, m: int) -> dict[int, list[tuple]]:
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
