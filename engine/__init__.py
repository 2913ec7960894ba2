"""A compact distributed-training engine that really runs: real ranks, real process groups.

Start here: :func:`engine.launch` runs a function on N ranks (Gloo on CPU, NCCL on GPUs), and
:class:`engine.observe.meter.CommMeter` records what each rank sent and received.
"""

from engine.launch import (
    LaunchError,
    RankDiedError,
    RankError,
    RankTimeoutError,
    launch,
)

__version__ = "0.1.0"
__all__ = ["launch", "LaunchError", "RankError", "RankDiedError", "RankTimeoutError"]
