"""Communication: metered wrappers over ``torch.distributed`` and the ``CommMeter``.

Strategies call collectives through :mod:`engine.comm.ops` so that a :class:`CommMeter` open on
the rank sees every byte. Collectives built from point-to-point sends (ring, parameter server,
tree) live beside them in this package.
"""

from engine.comm import ops
from engine.comm.meter import CommEvent, CommMeter

__all__ = ["CommMeter", "CommEvent", "ops"]
