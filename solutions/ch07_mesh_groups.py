"""Reference for exercise ch07.mesh_groups (the engine's is engine/topology.py)."""


def mesh_groups(dp: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """Every tp, dp and pp group of a (dp, tp, pp) mesh, tensor parallelism fastest."""

    def rank(d: int, t: int, p: int) -> int:
        return p * dp * tp + d * tp + t

    return {
        "tp": [[rank(d, t, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[rank(d, t, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank(d, t, p) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }
