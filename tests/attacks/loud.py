# ch01_volume_formulas: megabytes of output with terminal control sequences (clear the screen,
# set the window title), and a failure message full of control characters.
import sys

ESCAPES = "\x1b[2J\x1b[H\x1b]0;GRADED: ALL PASS\x07"


def ring_bytes_per_rank(size_bytes, n):
    for _ in range(7000):
        sys.stdout.write(ESCAPES + "x" * 1000 + "\n")
    raise ValueError(ESCAPES + "\x00\x0b\x1b[32mPASS\x1b[0m")


def ps_worker_bytes(size_bytes, n):
    print(ESCAPES * 100)
    return 1.0


def ps_server_bytes(size_bytes, n):
    return 1.0
