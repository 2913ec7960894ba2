"""Text to token ids and back, for ``python -m engine data prepare`` (:mod:`engine.model.prepare`):

* ``bytes``: each UTF-8 byte of the text is a token, vocabulary 256. Nothing to learn or
  download, so it is always there; any text, any language, round-trips exactly.
* ``bpe``: byte-pair encoding (Sennrich, Haddow and Birch 2016, "Neural Machine Translation of
  Rare Words with Subword Units") over bytes, as GPT-2 does it (Radford et al. 2019, section
  2.2: the 256 byte values are the base vocabulary, so no text is out of vocabulary; the text
  is first split GPT-2's way, so no merge crosses a word and its punctuation), *learned from
  the file itself* up to ``--vocab`` tokens by Hugging Face ``tokenizers`` (an optional
  package: absent, the command says so and falls back to ``bytes``). The learned tokenizer is
  saved as JSON beside the ``.bin``, so that ids can be decoded.
* ``gpt2``: GPT-2's own BPE (50,257 tokens) from ``tiktoken``, only when it is installed *and*
  its files are in tiktoken's cache: this course's machines may not download them. Otherwise a
  clear error.

:func:`decode` turns ids back into text with the tokenizer a token file's sidecar names
(:func:`engine.model.tokens.read_meta`): what a chapter calls to print generated text.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from engine.model.tokens import read_meta

TOKENIZERS = ("bytes", "bpe", "gpt2")
BYTES_VOCAB = 256
GPT2_VOCAB = 50_257


class NotCached(RuntimeError):
    """tiktoken would have downloaded a file it does not hold."""


def encode_bytes(text: str) -> np.ndarray:
    """``text``'s UTF-8 bytes as token ids (vocabulary 256)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def decode_bytes(ids) -> str:
    """The text of byte ids; a byte sequence cut inside a character shows U+FFFD there."""
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def bpe_missing() -> str | None:
    """Why ``bpe`` cannot run here (Hugging Face ``tokenizers`` not installed), else None."""
    if importlib.util.find_spec("tokenizers") is None:
        return "Hugging Face tokenizers is not installed (pip install tokenizers)"
    return None


def train_bpe(text: str, vocab: int, save_to) -> tuple[np.ndarray, int]:
    """Learn a byte-level BPE of at most ``vocab`` tokens (at least the 256 bytes) from
    ``text``, save it as JSON at ``save_to``; ``text``'s ids and the vocabulary's size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab < BYTES_VOCAB:
        raise ValueError(f"--vocab {vocab}: a byte-level BPE starts from the {BYTES_VOCAB} "
                         f"byte values; expected at least {BYTES_VOCAB}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text], trainer)
    tokenizer.save(str(save_to))
    return np.asarray(tokenizer.encode(text).ids, dtype=np.int64), tokenizer.get_vocab_size()


def gpt2_encoding():
    """tiktoken's GPT-2 encoding, read from tiktoken's cache only; a ValueError saying what is
    missing when tiktoken is not installed or its GPT-2 files are not cached."""
    try:
        import tiktoken
        import tiktoken.load as load
    except ImportError:
        raise ValueError("--tokenizer gpt2 needs tiktoken, which is not installed; expected "
                         "tiktoken with GPT-2's encoding in its cache, or use --tokenizer "
                         "bpe or bytes") from None
    fetch = getattr(load, "read_file", None)

    def offline(blobpath: str) -> bytes:  # tiktoken's cache misses land here: no download
        if "://" in blobpath:
            raise NotCached(blobpath)
        return fetch(blobpath)

    if fetch is not None:
        load.read_file = offline
    try:
        return tiktoken.get_encoding("gpt2")
    except NotCached:
        raise ValueError("--tokenizer gpt2: tiktoken is installed but GPT-2's encoding is not "
                         "in its cache ($TIKTOKEN_CACHE_DIR, else data-gym-cache in the "
                         "temporary folder), and it is not downloaded here; expected it "
                         "cached (run tiktoken.get_encoding('gpt2') once where there is a "
                         "network), or use --tokenizer bpe or bytes") from None
    finally:
        if fetch is not None:
            load.read_file = fetch


def decode(ids, path) -> str:
    """The text of token ``ids`` of the token file ``path``, by the tokenizer its sidecar
    names (a ``bpe`` file's tokenizer JSON is beside it)."""
    meta = read_meta(path)
    ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
    if meta["tokenizer"] == "bytes":
        return decode_bytes(ids)
    if meta["tokenizer"] == "bpe":
        if bpe_missing():
            raise ValueError(f"{path} was tokenised by a BPE, and {bpe_missing()}: expected "
                             "it installed to decode")
        from tokenizers import Tokenizer

        saved = Path(path).parent / meta["tokenizer_file"]
        return Tokenizer.from_file(str(saved)).decode(ids)
    if meta["tokenizer"] == "gpt2":
        return gpt2_encoding().decode(ids)
    raise ValueError(f"{path}: its sidecar names tokenizer {meta['tokenizer']!r}; expected "
                     f"one of {', '.join(TOKENIZERS)} to decode it")
