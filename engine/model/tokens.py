"""Real text to train on: a file of token ids, and the global batch of step k drawn from it.

**The file** is nanoGPT's ``.bin`` (Karpathy, nanoGPT ``data/shakespeare/prepare.py``): a flat
array of token ids, no header, as ``ids.tofile(path)`` writes it, read here with
``numpy.memmap`` (never loaded whole). nanoGPT always writes uint16; here the width is said by
a *sidecar*, ``PATH.json`` (``{"dtype": "uint16", "vocab": N, "tokenizer": ..., "source":
...}``, written with the file by :func:`write_tokens`, from ``python -m engine data prepare``:
:mod:`engine.model.prepare`): uint16 while every id fits (vocab at most 65,536), uint32 above.
A file without its sidecar is refused: read with the wrong width, every id would be wrong and
nothing would say so.

**The batch of step k** (:func:`file_batch`) is ``rows`` windows of ``seq_len + 1``
consecutive tokens, at offsets drawn uniformly from the whole file by a generator seeded with
``seed x 1,000,003 + step`` (the seeding of :func:`engine.model.data.global_batch`); ids are a
window's first ``seq_len`` tokens, targets its last ``seq_len``, as nanoGPT's ``get_batch``.
It is a function of (file, step, rows, seq_len, seed) alone, not of a generator's state, so
every rank draws the same whole batch and keeps its part (:func:`engine.compose.data.
rank_slice`): every layout and one process see the same sequences. No padding: the mask is
all ones, the positions ``0 .. seq_len - 1``.

:func:`batch_of_step` is the one function the trainer asks for step k's batch: the synthetic
chain of :func:`engine.model.data.global_batch` (bit-identical) without a file, the file's
windows with one. :func:`check_tokens` refuses, naming the value, what a run cannot train on.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np
import torch

from engine.model.data import Batch, global_batch

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SCAN_LIMIT = 2**28  # files up to this many tokens have every id checked against the vocab


def sidecar_path(path) -> Path:
    """Where the sidecar of the token file ``path`` is: ``PATH.json``."""
    return Path(str(path) + ".json")


def dtype_for(vocab: int) -> str:
    """The narrowest dtype of :data:`DTYPES` that holds every id below ``vocab``."""
    return "uint16" if vocab <= 2**16 else "uint32"


def write_tokens(path, ids: np.ndarray, vocab: int, tokenizer: str, source: str,
                 **extra) -> dict:
    """Write ``ids`` (each below ``vocab``) to ``path`` as :func:`dtype_for` ``(vocab)`` and
    the sidecar beside it (module docstring; ``extra``: more of its fields); the sidecar."""
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"token ids {ids.min()} to {ids.max()} do not fit a vocabulary of "
                         f"{vocab}")
    meta = {"dtype": dtype_for(vocab), "vocab": int(vocab), "tokenizer": tokenizer,
            "source": source, "tokens": int(ids.size), **extra}
    ids.astype(DTYPES[meta["dtype"]]).tofile(path)
    sidecar_path(path).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def read_meta(path) -> dict:
    """The sidecar of the token file ``path``, checked: a ValueError naming the path and
    what was expected if the file or its sidecar is missing or the sidecar is malformed."""
    path, side = Path(path), sidecar_path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file; expected a .bin of token ids, e.g. written by "
                         f"python -m engine data prepare TEXT_FILE --out {path}")
    if not side.is_file():
        raise ValueError(f"{path}: no sidecar {side} beside it, which says the ids' dtype and "
                         "vocabulary; expected the pair python -m engine data prepare writes "
                         '(for a nanoGPT .bin, write {"dtype": "uint16", "vocab": 50257} '
                         "there)")
    try:
        meta = json.loads(side.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{side}: not readable JSON ({e}); expected the sidecar python -m "
                         "engine data prepare writes") from None
    if not isinstance(meta, dict) or meta.get("dtype") not in DTYPES:
        got = meta.get("dtype") if isinstance(meta, dict) else meta
        raise ValueError(f"{side}: 'dtype' is {got!r}, expected one of {', '.join(DTYPES)}")
    vocab = meta.get("vocab")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise ValueError(f"{side}: 'vocab' is {vocab!r}, expected a positive integer")
    if vocab > np.iinfo(DTYPES[meta["dtype"]]).max + 1:
        raise ValueError(f"{side}: a vocabulary of {vocab} does not fit {meta['dtype']}; "
                         "expected dtype uint32")
    return meta


def token_count(path, meta: dict | None = None) -> int:
    """How many token ids the file ``path`` holds (its size over the sidecar's dtype's)."""
    meta = read_meta(path) if meta is None else meta
    size, width = os.path.getsize(path), np.dtype(DTYPES[meta["dtype"]]).itemsize
    if size % width:
        raise ValueError(f"{path}: {size:,} bytes is not a whole number of {meta['dtype']} "
                         f"ids ({width} bytes each); expected a file written as "
                         f"{meta['dtype']}, as its sidecar says")
    return size // width


def check_tokens(path, seq_len: int, vocab: int, model: str = "the model", hint: str = ""
                 ) -> dict:
    """The sidecar of ``path`` once a model of ``seq_len`` positions and ``vocab`` ids can
    train on it; else a ValueError naming the value and what was expected (``model``: how to
    name the model in it; ``hint``: how to give it a larger vocabulary). Every id is checked
    below the sidecar's vocab in files of up to :data:`SCAN_LIMIT` tokens (a larger one is
    trusted to its sidecar)."""
    meta = read_meta(path)
    n = token_count(path, meta)
    if n < seq_len + 1:
        raise ValueError(f"{path}: {n:,} tokens, fewer than seq_len + 1 = {seq_len + 1} "
                         f"({model}'s sequence and the target after it); expected a file of "
                         f"at least {seq_len + 1} tokens")
    if meta["vocab"] > vocab:
        raise ValueError(f"{path}: its ids run to {meta['vocab'] - 1:,} (vocab "
                         f"{meta['vocab']:,}, tokenizer {meta.get('tokenizer')}), and "
                         f"{model}'s vocabulary is {vocab:,}; expected a model vocabulary of "
                         f"at least {meta['vocab']:,}{hint}")
    largest = _largest_id(str(path), n) if n <= SCAN_LIMIT else None
    if largest is not None and largest >= meta["vocab"]:
        raise ValueError(f"{path}: holds token id {largest:,}, and its sidecar says vocab "
                         f"{meta['vocab']:,}; expected every id below it (a file and sidecar "
                         "of different runs?)")
    return meta


def file_tokens(path) -> np.memmap:
    """The ids of the token file ``path``, memory-mapped read-only, in its sidecar's dtype."""
    return _tokens(str(path), *_stamp(str(path)))


def _largest_id(path: str, n: int, chunk: int = 2**24) -> int:
    tokens = file_tokens(path)
    return max(int(tokens[i:i + chunk].max()) for i in range(0, n, chunk))


def _stamp(path: str) -> tuple[int, int]:
    """The file's modification time and size: a rewritten file is opened afresh."""
    stat = os.stat(path)
    return stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=4)
def _tokens(path: str, mtime_ns: int, size: int) -> np.memmap:
    meta = read_meta(path)
    return np.memmap(path, dtype=DTYPES[meta["dtype"]], mode="r",
                     shape=(token_count(path, meta),))


def file_batch(path, step: int, rows: int, seq_len: int, seed: int = 1) -> Batch:
    """The whole global batch of ``step`` from the token file ``path``: ``rows`` windows of
    ``seq_len + 1`` tokens at offsets drawn from ``(seed, step)`` (module docstring)."""
    tokens = file_tokens(path)
    if len(tokens) < seq_len + 1:
        raise ValueError(f"{path}: {len(tokens):,} tokens, fewer than seq_len + 1 = "
                         f"{seq_len + 1}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(tokens) - seq_len, (rows,), generator=g).tolist()
    stream = torch.from_numpy(np.stack([tokens[s:s + seq_len + 1] for s in starts])
                              .astype(np.int64))
    return Batch(stream[:, :-1].contiguous(), stream[:, 1:].contiguous(),
                 torch.ones(rows, seq_len), torch.arange(seq_len))


def batch_of_step(step: int, rows: int, seq_len: int, vocab: int, seed: int = 1,
                  varlen: bool = False, data=None) -> Batch:
    """Step ``step``'s whole global batch: :func:`engine.model.data.global_batch` without
    ``data``, :func:`file_batch` of the token file ``data`` with it (which has no packed
    documents: ``varlen`` is refused)."""
    if data is None:
        return global_batch(step, rows, seq_len, vocab, seed, varlen)
    if varlen:
        raise ValueError(f"varlen packs the synthetic chain's documents with padding; {data}'s "
                         "windows are whole text, none padded: expected varlen=False")
    return file_batch(data, step, rows, seq_len, seed)
