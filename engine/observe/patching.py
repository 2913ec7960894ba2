"""Replacing a module's attributes for a while, and putting them back: the engine's one patcher.

``with patched(torch.distributed, all_reduce=checked):`` calls through
``torch.distributed.all_reduce`` reach ``checked`` until the block ends; then the original is
back, even if the block raised. :mod:`engine.observe.nccl_rules` checks ``torch.distributed``'s
own ops this way, and :class:`engine.labs.fsdp2.TorchCollectives` records the collectives FSDP2
issues. An attribute the module did not have is removed again on exit.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

_MISSING = object()


@contextlib.contextmanager
def patched(module: Any, **replacements: Any) -> Iterator[dict[str, Any]]:
    """Set ``module.<name> = value`` for each replacement; restore every one on exit. Yields
    the originals (``{name: original}``, only those the module had)."""
    saved = {name: getattr(module, name, _MISSING) for name in replacements}
    for name, value in replacements.items():
        setattr(module, name, value)
    try:
        yield {name: old for name, old in saved.items() if old is not _MISSING}
    finally:
        for name, old in saved.items():
            if old is _MISSING:
                delattr(module, name)
            else:
                setattr(module, name, old)
