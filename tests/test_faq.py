"""docs/faq.md says only what is true of the course: every command it shows names flags that
exist (the trainer's ``--help``, torchrun's options, the benchmark scripts' own), with values the
trainer accepts at the world size the command launches; every file and engine name it cites
exists; the numbers it computes from formulas are the formulas'; the README links it."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from engine import theory
from engine.cp.balance import rank_flops
from engine.theory.hardware import PEAK_TFLOPS
from engine.model.presets import MODELS
from engine.train.cli import check_config, parse
from tests.test_lab_guide import commands, trainer_flags

REPO = Path(__file__).resolve().parents[1]
FAQ = (REPO / "docs/faq.md").read_text()
JOINED = re.sub(r"\\\n\s*", " ", FAQ)  # continued lines joined


def torchrun_flags() -> set[str]:
    return {o for action in get_args_parser()._actions for o in action.option_strings}


def script_flags(path: Path) -> set[str]:
    """The options a script declares with ``add_argument("--name", ...)`` (read, not run)."""
    flags = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags |= {a.value for a in node.args
                      if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return flags


def benchmark_commands() -> list[tuple[str, str]]:
    return re.findall(r"python (benchmarks/[\w]+\.py)([^\n`#]*)", JOINED)


def torchrun_commands() -> list[tuple[str, str]]:
    """(torchrun's options, the trainer's arguments) of every torchrun command."""
    return re.findall(r"torchrun ([^\n`#]*?)-m engine train\b([^\n`#>&|]*)", JOINED)


def _world(args: list[str], torchrun: str = "") -> int | None:
    """The world size a command launches: --world-size, or torchrun's processes x nodes."""
    said = dict(zip(args, args[1:]))
    if "--world-size" in said:
        return int(said["--world-size"])
    options = torchrun.split()
    launcher = dict(zip(options, options[1:]))
    if "--nproc-per-node" in launcher:
        return int(launcher["--nproc-per-node"]) * int(launcher.get("--nnodes", 1))
    return None


def test_the_faq_shows_commands_of_each_kind_and_the_readme_links_it():
    assert len(commands(JOINED)) >= 10
    assert len(torchrun_commands()) >= 5 and len(benchmark_commands()) >= 4
    assert "(docs/faq.md)" in (REPO / "README.md").read_text()


@pytest.mark.parametrize("args", commands(JOINED))
def test_every_trainer_command_parses_and_fits_its_world(args):
    tokens = args.split()
    flags = {t.split("=", 1)[0] for t in tokens if t.startswith("--")}
    assert flags <= trainer_flags(), f"`-m engine train {args}` names " \
                                     f"{sorted(flags - trainer_flags())}"
    torchrun = next((t for t, a in torchrun_commands() if a.strip() == args), "")
    cfg, parsed, _ = parse(tokens)
    world = _world(tokens, torchrun) or parsed.world_size or cfg.world_size
    check_config(cfg, world)  # a ValueError names what does not fit


@pytest.mark.parametrize("launcher, args", torchrun_commands())
def test_every_torchrun_option_is_torchruns(launcher, args):
    named = {t.split("=", 1)[0] for t in launcher.split() if t.startswith("--")}
    assert named <= torchrun_flags(), sorted(named - torchrun_flags())


@pytest.mark.parametrize("script, args", benchmark_commands())
def test_every_benchmark_command_names_its_scripts_flags(script, args):
    path = REPO / script
    assert path.is_file(), script
    named = {t.split("=", 1)[0] for t in args.split() if t.startswith("--")}
    assert named <= script_flags(path), f"{script} has no {sorted(named - script_flags(path))}"


def test_every_flag_the_text_names_belongs_to_a_command_shown():
    known = trainer_flags() | torchrun_flags()
    for script, _ in benchmark_commands():
        known |= script_flags(REPO / script)
    named = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", FAQ))
    assert named <= known, sorted(named - known)


def test_every_file_and_engine_name_cited_exists():
    for path in set(re.findall(r"`((?:docs|benchmarks|engine|scripts|tests)/[\w/.]+)`", FAQ)):
        assert (REPO / path).exists(), path
    for dotted in set(re.findall(r"`((?:engine|theory)\.[\w.]+)`", FAQ)):
        parts = ("engine." + dotted if dotted.startswith("theory.") else dotted).split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
            try:
                found = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        for part in parts[cut:]:
            found = getattr(found, part)  # an AttributeError names the name that is not there
    assert "`--model medium` has a\nhidden size of 256 and 128-token sequences" in FAQ
    assert (MODELS["medium"].hidden, MODELS["medium"].seq_len, MODELS["medium"].heads) == \
        (256, 128, 8)


def test_every_engine_command_named_is_one_python_m_engine_has(capsys):
    from engine.__main__ import main

    main(["--help"])
    usage = capsys.readouterr().out
    named = set(re.findall(r"python -m engine (\w+)", JOINED))
    assert {"train", "parity"} <= named
    assert all(re.search(rf"^  {name}\b", usage, re.M) for name in named), (named, usage)


def test_the_numbers_computed_from_formulas_are_the_formulas():
    assert f"**{theory.bubble_fraction(2, 4):.0%}** at p = 2, m = 4" in FAQ
    n = 4
    contiguous, zigzag = (max(rank_flops(2048, n, layout)) for layout in ("contiguous",
                                                                          "zigzag"))
    assert f"**4N/(2N+1) = {contiguous / zigzag:.2f}x**" in FAQ and \
        contiguous / zigzag == pytest.approx(4 * n / (2 * n + 1))
    assert f"**2 - 1/N = {2 - 1 / n:.2f}x**" in FAQ
    long = 1 << 20  # the ratio tends to 2 - 1/N as S grows
    assert theory.ring_critical_path(long, n, "contiguous") / \
        theory.ring_critical_path(long, n, "zigzag") == pytest.approx(2 - 1 / n, abs=1e-5)
    peak = PEAK_TFLOPS["NVIDIA H100 80GB HBM3"]["bf16"]
    flops = 2 * (4 * MODELS["medium"].seq_len) * MODELS["medium"].hidden ** 2
    assert f"{peak:g} TFLOP/s dense BF16 for an H100" in FAQ
    assert f"= {flops / 1e6:.0f} MFLOP, about {flops / (peak * 1e12) * 1e9:.0f} ns" in FAQ


def test_the_zigzag_benchmark_prints_median_and_spread_after_a_warm_up(capsys):
    from benchmarks.zigzag_spread import main

    assert main(["--n", "2", "--seq", "64", "--warmup", "1", "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    assert "1 warm-up pass(es) discarded, 3 timed" in out
    for row in ("contiguous  busiest rank:", "zigzag      busiest rank:", "speed-up"):
        line = next(x for x in out.splitlines() if row in x)
        assert re.search(r"median [\d.]+\D+ \[p10 [\d.]+\D+, p90 [\d.]+\D+\] \(min [\d.]+\D+, "
                         r"max [\d.]+\D+\)", line), line
    assert f"busiest rank's FLOPs {4 * 2 / 5:.3f}x" in out
