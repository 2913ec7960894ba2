"""``python -m engine data``: a text file as token ids to train on, and back.

    python -m engine data prepare course/data/alice.txt --out /tmp/alice.bin
    python -m engine data prepare course/data/alice.txt --out /tmp/alice.bin --tokenizer bpe \\
        --vocab 512
    python -m engine data decode /tmp/alice.bin --offset 0 --count 200

``prepare`` tokenises the text (:mod:`engine.model.tokenizer`: ``bytes``, the default and
always there; ``bpe`` learned from the file, which falls back to ``bytes``, saying so, without
Hugging Face ``tokenizers``; ``gpt2`` from tiktoken's cache) and writes nanoGPT's ``.bin`` and
its sidecar ``PATH.json`` (:mod:`engine.model.tokens`), as nanoGPT's ``data/*/prepare.py``
writes ``train.bin``; ``python -m engine train --data PATH`` trains on it. ``decode`` prints
the text of a stretch of the file: what the ids say.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.model.tokenizer import BYTES_VOCAB, TOKENIZERS, bpe_missing, decode, \
    encode_bytes, gpt2_encoding, train_bpe
from engine.model.tokens import file_tokens, read_meta, token_count, write_tokens
from engine.validation import ArgumentParser

DEFAULT_BPE_VOCAB = 512


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m engine data", description=__doc__.split("\n\n")[0],
                       allow_abbrev=False)
    commands = p.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    prepare = commands.add_parser("prepare", help="tokenise a text file into PATH (.bin) and "
                                                  "PATH.json", allow_abbrev=False)
    prepare.add_argument("text", metavar="TEXT_FILE", help="a UTF-8 text file")
    prepare.add_argument("--out", required=True, metavar="PATH",
                         help="the token file to write (its sidecar: PATH.json)")
    prepare.add_argument("--tokenizer", default="bytes", choices=TOKENIZERS,
                         help="bytes: one token per UTF-8 byte (vocab 256); bpe: a byte-level "
                              "BPE learned from the file (Hugging Face tokenizers; without "
                              "it, bytes); gpt2: GPT-2's BPE from tiktoken's cache "
                              "(default: %(default)s)")
    prepare.add_argument("--vocab", type=int, default=None, metavar="N",
                         help=f"--tokenizer bpe's vocabulary, at least {BYTES_VOCAB} "
                              f"(default: {DEFAULT_BPE_VOCAB})")
    show = commands.add_parser("decode", help="print the text of a stretch of a token file",
                               allow_abbrev=False)
    show.add_argument("path", metavar="PATH", help="a token file with its sidecar PATH.json")
    show.add_argument("--offset", type=int, default=0, help="the first token (default: 0)")
    show.add_argument("--count", type=int, default=200, help="tokens (default: %(default)s)")
    return p


def main(argv=None) -> int:
    """``python -m engine data ARGV``; its exit code (2, with one line, on a bad input)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parser().parse_args(argv)
        if args.command == "prepare":
            print(prepare(args.text, args.out, args.tokenizer, args.vocab))
        else:
            print(shown(args.path, args.offset, args.count))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def prepare(text_file, out, tokenizer: str = "bytes", vocab: int | None = None) -> str:
    """Tokenise ``text_file`` with ``tokenizer`` and write ``out`` and its sidecar; what was
    done, in a few lines (a ValueError naming the value for a bad input)."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"--tokenizer {tokenizer!r}: expected one of {', '.join(TOKENIZERS)}")
    if vocab is not None and tokenizer != "bpe":
        raise ValueError(f"--vocab {vocab} sets the size of a learned BPE; --tokenizer "
                         f"{tokenizer} has its own ({BYTES_VOCAB} bytes, GPT-2's 50,257): "
                         "expected --vocab only with --tokenizer bpe")
    text = _read_text(Path(text_file))
    out = Path(out)
    if not out.parent.is_dir():
        raise ValueError(f"--out {out}: the folder {out.parent} does not exist; expected an "
                         "existing folder")
    said, extra = [], {}
    if tokenizer == "bpe" and bpe_missing():
        said.append(f"--tokenizer bpe: {bpe_missing()}; fell back to --tokenizer bytes")
        tokenizer = "bytes"
    if tokenizer == "bytes":
        ids, size = encode_bytes(text), BYTES_VOCAB
    elif tokenizer == "bpe":
        saved = Path(str(out) + ".tokenizer.json")
        ids, size = train_bpe(text, DEFAULT_BPE_VOCAB if vocab is None else vocab, saved)
        extra["tokenizer_file"] = saved.name
        said.append(f"learned a byte-level BPE of {size:,} tokens, saved as {saved}")
    else:
        encoding = gpt2_encoding()
        ids, size = encoding.encode_ordinary(text), encoding.n_vocab
    meta = write_tokens(out, ids, size, tokenizer, Path(text_file).name, **extra)
    said.append(f"wrote {meta['tokens']:,} tokens of {Path(text_file).name} ({tokenizer}, "
                f"vocab {size:,}, {meta['dtype']}) to {out}, and its sidecar {out}.json")
    said.append(f"train on it: python -m engine train --model llama-tiny --vocab {size} "
                f"--data {out}")
    return "\n".join(said)


def shown(path, offset: int = 0, count: int = 200) -> str:
    """The text of tokens ``offset`` to ``offset + count`` of the token file ``path``."""
    n = token_count(path, read_meta(path))
    if not 0 <= offset < n or count < 1:
        raise ValueError(f"--offset {offset} --count {count}: {path} holds {n:,} tokens; "
                         f"expected 0 <= offset < {n:,} and count >= 1")
    return decode(file_tokens(path)[offset:offset + count], path)


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise ValueError(f"{path}: no such file; expected a UTF-8 text file to tokenise")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); expected a "
                         "UTF-8 text file") from None
    if not text:
        raise ValueError(f"{path}: empty; expected a text to tokenise")
    return text
