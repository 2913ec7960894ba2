"""Exercise ch00.p2p_broadcast: a broadcast built from point-to-point sends.

Fill in ``p2p_broadcast``, save, then run ``check("ch00.p2p_broadcast")`` in
course/00_setup.ipynb (or ``make grade``).
"""

import torch

from engine.comm import ops  # noqa: F401  (you will need it)


def p2p_broadcast(tensor: torch.Tensor, src: int) -> torch.Tensor:
    """Copy ``tensor`` from rank ``src`` into ``tensor`` on every rank, in place; return it.

    Use only ``ops.send(t, dst)`` and ``ops.recv(t, src)`` (or their async forms) so the
    ``CommMeter`` sees your traffic. ``torch.distributed.get_rank()`` and
    ``get_world_size()`` tell you who you are. The source's tensor must not change.
    """
    raise NotImplementedError("ch00.p2p_broadcast: write me")
