# ch01_volume_formulas: allocate 6 GB and touch every page, then answer rightly.
import torch


def ring_bytes_per_rank(size_bytes, n):
    hog = torch.empty(6 * 2**30, dtype=torch.uint8)
    hog.fill_(1)
    return 2 * (n - 1) / n * size_bytes


def ps_worker_bytes(size_bytes, n):
    return size_bytes if n > 1 else 0


def ps_server_bytes(size_bytes, n):
    return (n - 1) * size_bytes
