"""Reference for exercise ch04.memory_formula."""


def bytes_per_gpu(psi: float, n: int, stage: int, precision: str = "mixed") -> float:
    param, grad, optim = (2, 2, 12) if precision == "mixed" else (4, 4, 8)
    return psi * (param / (n if stage >= 3 else 1) + grad / (n if stage >= 2 else 1)
                  + optim / (n if stage >= 1 else 1))
