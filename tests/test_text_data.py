"""Training on real text: ``python -m engine data prepare`` writes nanoGPT's ``.bin`` and its
sidecar (engine.model.prepare, engine.model.tokenizer), the batch of step k is a function of
(file, step, rows, seq_len, seed) alone (engine.model.tokens), so every layout trains on the
same sequences as one process; ``engine train --data`` refuses, naming the value, what it
cannot train on; and llama-tiny learns the shipped text (course/data)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.__main__ import main as engine_main
from engine.model import prepare as prepare_module
from engine.model.data import global_batch
from engine.model.prepare import prepare
from engine.model.tokenizer import bpe_missing, decode
from engine.model.tokens import batch_of_step, file_batch, file_tokens, write_tokens

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "course" / "data" / "alice.txt"
TEXT = ("Naïve café owners sold crème brûlée — to Zoë, twice.\n"
        "The quick brown fox jumps over the lazy dog; the dog sleeps on.\n") * 40
TOLERANCE = 1e-6


def _losses(out: str) -> list[float]:
    line = next(line for line in out.splitlines() if line.startswith("  loss per step ("))
    return [float(x) for x in re.findall(r"\d+\.\d+", line.split(":", 1)[1])]


def _train(args: list[str], capsys) -> list[float]:
    assert engine_main(["train", *args]) == 0, capsys.readouterr().err
    return _losses(capsys.readouterr().out)


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture
def alice(tmp_path) -> Path:
    out = tmp_path / "alice.bin"
    prepare(SHIPPED, out)
    return out


# -- prepare and decode ------------------------------------------------------------------------


def test_bytes_prepare_writes_the_bin_and_sidecar_and_decodes_back(text_file, tmp_path, capsys):
    out = tmp_path / "text.bin"
    assert engine_main(["data", "prepare", str(text_file), "--out", str(out)]) == 0
    assert "vocab 256, uint16" in capsys.readouterr().out
    meta = json.loads(Path(f"{out}.json").read_text())
    assert meta == {"dtype": "uint16", "vocab": 256, "tokenizer": "bytes",
                    "source": "text.txt", "tokens": len(TEXT.encode("utf-8"))}
    ids = np.fromfile(out, dtype=np.uint16)  # nanoGPT's layout: no header
    assert ids.tolist() == list(TEXT.encode("utf-8"))
    assert decode(ids, out) == TEXT
    line = TEXT[:TEXT.index("\n") + 1]
    count = str(len(line.encode("utf-8")))
    assert engine_main(["data", "decode", str(out), "--offset", "0", "--count", count]) == 0
    assert capsys.readouterr().out == line + "\n"


@pytest.mark.skipif(bpe_missing() is not None, reason=f"bpe: {bpe_missing()}")
def test_bpe_is_learned_from_the_file_and_decodes_back(text_file, tmp_path):
    out = tmp_path / "text.bin"
    said = prepare(text_file, out, "bpe", vocab=300)
    meta = json.loads(Path(f"{out}.json").read_text())
    assert meta["tokenizer"] == "bpe" and 256 < meta["vocab"] <= 300, meta
    assert (tmp_path / meta["tokenizer_file"]).is_file() and "learned a byte-level BPE" in said
    ids = file_tokens(out)
    assert len(ids) < len(TEXT.encode("utf-8")) / 2  # merges: fewer tokens than bytes
    assert ids.max() < meta["vocab"] and decode(ids, out) == TEXT


def test_bpe_without_tokenizers_falls_back_to_bytes_and_says_so(text_file, tmp_path,
                                                                monkeypatch):
    monkeypatch.setattr(prepare_module, "bpe_missing", lambda: "tokenizers is absent here")
    out = tmp_path / "text.bin"
    said = prepare(text_file, out, "bpe")
    assert "tokenizers is absent here; fell back to --tokenizer bytes" in said
    assert json.loads(Path(f"{out}.json").read_text())["tokenizer"] == "bytes"
    assert decode(file_tokens(out), out) == TEXT


def test_gpt2_needs_tiktoken_with_its_files_cached(text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))  # nothing cached
    with pytest.raises(ValueError, match="--tokenizer gpt2") as e:
        prepare(text_file, tmp_path / "text.bin", "gpt2")
    assert "not installed" in str(e.value) or "not in its cache" in str(e.value)
    assert not (tmp_path / "text.bin").exists()


@pytest.mark.parametrize("argv, message", [
    (["--tokenizer", "bytes", "--vocab", "300"], "--vocab 300 sets the size of a learned BPE"),
    (["--out", "/no/such/folder/x.bin"], "--out /no/such/folder/x.bin: the folder"),
])
def test_prepare_refuses_naming_the_value(text_file, tmp_path, argv, message, capsys):
    out = ["--out", str(tmp_path / "x.bin")] if "--out" not in argv else []
    assert engine_main(["data", "prepare", str(text_file), *out, *argv]) == 2
    assert message in capsys.readouterr().err


def test_prepare_refuses_a_missing_or_non_utf8_text(tmp_path, capsys):
    assert engine_main(["data", "prepare", str(tmp_path / "none.txt"), "--out",
                        str(tmp_path / "x.bin")]) == 2
    assert "none.txt: no such file" in capsys.readouterr().err
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    assert engine_main(["data", "prepare", str(tmp_path / "latin1.txt"), "--out",
                        str(tmp_path / "x.bin")]) == 2
    assert "latin1.txt: not UTF-8 text (byte 3" in capsys.readouterr().err


def test_a_vocabulary_above_65536_is_written_as_uint32(tmp_path):
    out = tmp_path / "wide.bin"
    meta = write_tokens(out, np.array([0, 70_000, 5]), 100_000, "gpt2", "x")
    assert meta["dtype"] == "uint32" and file_tokens(out).tolist() == [0, 70_000, 5]
    assert write_tokens(tmp_path / "n.bin", np.array([65_535]), 65_536, "x", "x")["dtype"] \
        == "uint16"


# -- the batch of step k -------------------------------------------------------------------------


def test_the_batch_of_step_k_is_a_function_of_file_step_rows_seq_len_and_seed(alice):
    first = file_batch(alice, 3, rows=8, seq_len=16, seed=1)
    again = file_batch(alice, 3, rows=8, seq_len=16, seed=1)
    for a, b in zip((first.ids, first.targets, first.mask, first.positions),
                    (again.ids, again.targets, again.mask, again.positions)):
        assert torch.equal(a, b)
    assert not torch.equal(first.ids, file_batch(alice, 4, 8, 16, seed=1).ids)
    assert not torch.equal(first.ids, file_batch(alice, 3, 8, 16, seed=2).ids)
    assert torch.equal(first.ids[:, 1:], first.targets[:, :-1])  # targets: the next token
    assert torch.equal(first.mask, torch.ones(8, 16)) and first.tokens == 8 * 16
    assert torch.equal(first.positions, torch.arange(16))
    text = SHIPPED.read_bytes()
    for row, target in zip(first.ids, first.targets):  # each a window of the text
        window = bytes(row.tolist()) + bytes([int(target[-1])])
        assert window in text


def test_without_data_the_batch_is_the_synthetic_chain_bit_for_bit():
    for varlen in (False, True):
        ours = batch_of_step(5, 8, 16, 64, seed=1, varlen=varlen)
        theirs = global_batch(5, 8, 16, 64, seed=1, varlen=varlen)
        for a, b in zip((ours.ids, ours.targets, ours.mask, ours.positions),
                        (theirs.ids, theirs.targets, theirs.mask, theirs.positions)):
            assert torch.equal(a, b)


def test_a_file_batch_has_no_packed_documents(alice):
    with pytest.raises(ValueError, match="varlen"):
        batch_of_step(0, 8, 16, 256, seed=1, varlen=True, data=alice)


LAYOUTS = {
    "dp2": ["--dp", "2", "--microbatches", "2", "--micro-batch", "2"],
    "cp2 x tp2": ["--cp", "2", "--tp", "2", "--microbatches", "2", "--micro-batch", "4"],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_trains_on_the_file_as_one_process(alice, layout, capsys):
    common = ["--model", "llama-tiny", "--vocab", "256", "--data", str(alice), "--steps", "3"]
    one = _train([*common, "--world-size", "1", "--microbatches", "2", "--micro-batch", "4"],
                 capsys)
    parallel = _train([*common, *LAYOUTS[layout]], capsys)
    assert len(one) == len(parallel) == 3
    assert max(abs(a - b) for a, b in zip(one, parallel)) < TOLERANCE, (one, parallel)


def test_llama_tiny_learns_the_shipped_text(alice, capsys):
    losses = _train(["--model", "llama-tiny", "--vocab", "256", "--data", str(alice),
                     "--steps", "30", "--world-size", "1"], capsys)
    assert len(losses) == 30
    assert abs(losses[0] - math.log(256)) < 0.2  # a fresh model: about uniform over bytes
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses  # it learns the text


# -- refusals, before any rank starts ------------------------------------------------------------


def _refused(args: list[str], capsys) -> str:
    assert engine_main(["train", "--steps", "1", "--world-size", "1", *args]) == 2
    return capsys.readouterr().err


def test_a_missing_file_or_sidecar_is_refused_naming_the_path(alice, tmp_path, capsys):
    missing = tmp_path / "missing.bin"
    assert f"--data {missing}: no such file" in _refused(["--vocab", "256", "--data",
                                                          str(missing)], capsys)
    bare = tmp_path / "bare.bin"
    bare.write_bytes(alice.read_bytes())  # a .bin without its sidecar
    err = _refused(["--vocab", "256", "--data", str(bare)], capsys)
    assert f"--data {bare}: no sidecar {bare}.json" in err and '"dtype": "uint16"' in err


def test_a_file_shorter_than_a_sequence_is_refused(tmp_path, capsys):
    short = tmp_path / "short.bin"
    write_tokens(short, np.arange(10), 64, "bytes", "x")
    err = _refused(["--data", str(short)], capsys)
    assert f"--data {short}: 10 tokens, fewer than seq_len + 1 = 17" in err


def test_ids_beyond_the_models_vocabulary_are_refused(alice, capsys):
    err = _refused(["--model", "llama-tiny", "--data", str(alice)], capsys)
    assert "--model llama-tiny's vocabulary is 64" in err and "pass --vocab 256" in err
    err = _refused(["--model", "llama-tiny", "--vocab", "100", "--data", str(alice)], capsys)
    assert "--vocab 100 is less than the vocabulary of --data" in err and "256" in err


def test_ids_beyond_the_sidecars_vocabulary_are_refused(tmp_path, capsys):
    lying = tmp_path / "lying.bin"
    write_tokens(lying, np.arange(100) % 50, 64, "bytes", "x")
    sidecar = Path(f"{lying}.json")
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "vocab": 40}))
    err = _refused(["--data", str(lying)], capsys)
    assert "holds token id 49" in err and "vocab 40" in err


def test_a_malformed_sidecar_is_refused_naming_the_field(alice, capsys):
    sidecar = Path(f"{alice}.json")
    sidecar.write_text(json.dumps({"dtype": "int8", "vocab": 256}))
    assert "'dtype' is 'int8', expected one of uint16, uint32" in \
        _refused(["--vocab", "256", "--data", str(alice)], capsys)


def test_varlen_cannot_go_with_data(alice, capsys):
    assert "--varlen packs the synthetic chain's documents" in \
        _refused(["--vocab", "256", "--data", str(alice), "--varlen"], capsys)


def test_pytorchs_side_trains_on_the_same_windows(alice, capsys):
    """--impl both: PyTorch's DDP + ZeroRedundancyOptimizer and the engine, the same file's
    windows of each step, the same losses."""
    assert engine_main(["train", "--model", "llama-tiny", "--vocab", "256", "--data",
                        str(alice), "--steps", "3", "--world-size", "2", "--dp", "2",
                        "--impl", "both"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "loss per step" in line]
    engine, torch_ = (_losses(line) for line in lines)
    assert len(lines) == 2 and len(engine) == len(torch_) == 3
    # two implementations sum in different orders: equal within fp32 rounding of the loss
    assert max(abs(a - b) for a, b in zip(engine, torch_)) <= 1e-6


@pytest.mark.parametrize("vocab, message", [
    ("1", "--vocab must be at least 2"), ("0", "--vocab must be a positive int, got 0"),
    ("2000000", "--vocab must be at most 1,048,576"),
])
def test_a_vocabulary_out_of_range_is_refused(vocab, message, capsys):
    assert message in _refused(["--vocab", vocab], capsys)


def test_vocab_alone_trains_the_synthetic_chain_over_it(capsys):
    losses = _train(["--vocab", "128", "--steps", "2", "--world-size", "1"], capsys)
    assert abs(losses[0] - math.log(128)) < 0.3


# -- the shipped text ----------------------------------------------------------------------------


def test_the_shipped_text_is_small_plain_and_says_where_it_comes_from():
    data = SHIPPED.read_bytes()
    assert len(data) < 2 * 2**20 and data.isascii() and b"\r" not in data
    assert b"Gutenberg" not in data  # no licence header or footer
    readme = (SHIPPED.parent / "README.md").read_text()
    for needed in ("public domain", "alice29.txt", "Canterbury Corpus", "brotli"):
        assert needed in readme
