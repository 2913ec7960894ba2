"""The lab guide and the README say only what is true of the trainer and the course: every
``python -m engine train ...`` and ``torchrun ... -m engine train ...`` command they show names
only flags the trainer's ``--help`` lists, with values it accepts; the guide's model list is the
trainer's; and every list of the chapters with a GPU-lab cell names exactly those chapters."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engine.model.presets import MODELS
from engine.train.cli import parse, parser

REPO = Path(__file__).resolve().parents[1]
DOCS = ("docs/lab.md", "README.md")
PLACEHOLDERS = ("...", "…", "$", "<", "ARGS")  # a command shown in outline, not to be parsed


def commands(text: str) -> list[str]:
    """The trainer arguments of every ``-m engine train`` command in ``text``: continued lines
    joined, up to the end of the line, a closing backtick, a comment or a redirection."""
    joined = re.sub(r"\\\n\s*", " ", text)
    found = []
    for match in re.finditer(r"-m engine train\b([^\n`#>&|]*)", joined):
        found.append(match.group(1).strip())
    return found


def trainer_flags() -> set[str]:
    return {option for action in parser()._actions for option in action.option_strings}


def all_commands() -> list[tuple[str, str]]:
    return [(doc, args) for doc in DOCS for args in commands((REPO / doc).read_text())]


def test_the_docs_show_trainer_commands():
    found = all_commands()
    assert sum(doc == "docs/lab.md" for doc, _ in found) >= 12, found
    assert sum(doc == "README.md" for doc, _ in found) >= 3, found


@pytest.mark.parametrize("doc, args", all_commands())
def test_every_flag_of_every_command_is_one_the_trainer_has(doc, args):
    flags = {token.split("=", 1)[0] for token in args.split() if token.startswith("--")}
    unknown = sorted(flags - trainer_flags())
    assert not unknown, f"{doc}: `-m engine train {args}` names {unknown}, which " \
                        "`python -m engine train --help` does not list"
    if not any(mark in args for mark in PLACEHOLDERS) and "--help" not in flags:
        parse(args.split())  # every value one the trainer takes (a ValueError names it)


def test_the_guides_model_list_is_the_trainers():
    text = (REPO / "docs/lab.md").read_text()
    listed = re.search(r"`--model ([\w|-]+)`", text).group(1).split("|")
    assert listed == list(MODELS)


def test_the_guide_names_the_trainers_layout_flags():
    text = (REPO / "docs/lab.md").read_text()
    section = text.split("## 4. One node", 1)[1].split("```", 1)[0]
    named = set(re.findall(r"`(--[\w-]+)", section))
    assert {"--dp", "--ep", "--tp", "--pp", "--zero", "--compress", "--model"} <= named
    assert named <= trainer_flags(), named - trainer_flags()


# -- the chapters with a GPU-lab cell ----------------------------------------------------------


def gpu_lab_chapters(trainer_cell_only: bool) -> set[str]:
    """The chapters whose notebook has a GPU-lab section (a heading that says "GPU lab"); with
    ``trainer_cell_only``, those whose cell runs the trainer (``run_on_gpus``)."""
    chapters = set()
    for notebook in sorted((REPO / "course").glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        text = ["".join(c["source"]) for c in cells]
        heading = any(c["cell_type"] == "markdown" and
                      re.search(r"^#+ .*GPU lab", t, re.M) for c, t in zip(cells, text))
        trainer = any(c["cell_type"] == "code" and "run_on_gpus(" in t
                      for c, t in zip(cells, text))
        if heading and (trainer or not trainer_cell_only):
            chapters.add(notebook.name[:2])
    return chapters


def named_chapters(phrase: str) -> set[str]:
    """``"02 to 07 and 10"`` -> {"02", ..., "07", "10"}."""
    chapters = set()
    for part in re.split(r", | and ", phrase):
        ends = [int(n) for n in re.findall(r"\d\d", part)]
        chapters |= {f"{n:02d}" for n in range(ends[0], ends[-1] + 1)}
    return chapters


CHAPTER_LIST = r"(\d\d(?: to \d\d)?(?:(?:, | and )\d\d(?: to \d\d)?)*)"


@pytest.mark.parametrize("doc, pattern, trainer_cell_only", [
    ("README.md", r"Chapters " + CHAPTER_LIST + r" end with a marked \*\*GPU-lab cell\*\*", True),
    ("docs/lab.md", r"the GPU-lab cells at the end of chapters " + CHAPTER_LIST, True),
    ("course/README.md", r"Chapters " + CHAPTER_LIST + r" also have a\s+marked \*GPU lab\* cell",
     False),
])
def test_every_list_of_gpu_lab_chapters_is_true(doc, pattern, trainer_cell_only):
    said = re.search(pattern, (REPO / doc).read_text())
    assert said, f"{doc} no longer lists the GPU-lab chapters as {pattern!r}"
    assert named_chapters(said.group(1)) == gpu_lab_chapters(trainer_cell_only), \
        f"{doc} says chapters {said.group(1)}; the notebooks with a GPU-lab " \
        f"{'trainer cell' if trainer_cell_only else 'section'} are " \
        f"{sorted(gpu_lab_chapters(trainer_cell_only))}"
