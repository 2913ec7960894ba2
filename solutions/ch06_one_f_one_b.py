"""Reference for exercise ch06.one_f_one_b: the engine's own schedule, read it in
engine/pp/schedules.py."""

from engine.pp import schedules


def one_f_one_b(p: int, m: int) -> dict[int, list[tuple]]:
    return schedules.one_f_one_b(p, m)
