"""The book (``make book``, ``scripts/build_book.py``) on a two-chapter course built here: pages
with every output and figure, contents and neighbours linked, widgets' state embedded, the
sources left stripped; a chapter that raises, or a saved run that is incomplete, builds nothing.
The real chapters' book is opened in Chromium by tests/test_browser.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip(
    "nbformat", reason="reads the course notebooks; nbformat is not installed here")

ROOT = Path(__file__).resolve().parents[1]
BUILD_BOOK = ROOT / "scripts" / "build_book.py"
v4 = nbformat.v4


def _write(folder: Path, name: str, *cells) -> Path:
    notebook = v4.new_notebook(cells=list(cells))
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    nbformat.write(notebook, folder / name)
    return folder / name


def _build(course: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BUILD_BOOK), "--course", str(course),
                           "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    course = tmp_path_factory.mktemp("course")
    _write(course, "00_first.ipynb",
           v4.new_markdown_cell("# 00 · First\n\nOn to [the second](01_second.ipynb); [a file "
                                "outside](../docs/lab.md); [the web](https://example.org)."),
           v4.new_code_cell("import matplotlib.pyplot as plt\nprint('measured', 6 * 7)\n"
                            "plt.plot([1, 2, 3]); plt.show()"),
           v4.new_code_cell("import ipywidgets\nipywidgets.IntSlider(value=3)"))
    _write(course, "01_second.ipynb", v4.new_markdown_cell("# 01 · Second"),
           v4.new_code_cell("print('second chapter ran')"))
    (course / "README.md").write_text("# The map\n\n| [first](00_first.ipynb) | 1 s |\n|-|-|\n")
    sources = {p.name: p.read_text() for p in course.glob("*.ipynb")}
    out = tmp_path_factory.mktemp("book")
    (out / "99_removed.html").write_text("a page from an earlier build")
    built = _build(course, out)
    assert built.returncode == 0, built.stderr
    return course, out, sources


@pytest.mark.slow
def test_a_chapter_page_shows_its_output_and_its_figure(book):
    _, out, _ = book
    page = (out / "00_first.html").read_text()
    assert "measured 42" in page
    figures = re.findall(r'<img[^>]+src="data:image/png;base64,', page)
    assert len(figures) == 1, f"{len(figures)} embedded figures, expected the one plotted"
    assert "second chapter ran" in (out / "01_second.html").read_text()


@pytest.mark.slow
def test_the_contents_link_every_chapter_by_title_then_show_the_map(book):
    _, out, _ = book
    index = (out / "index.html").read_text()
    assert '<a href="00_first.html">00 · First</a>' in index
    assert '<a href="01_second.html">01 · Second</a>' in index
    assert "The map" in index and '<a href="00_first.html">first</a>' in index
    assert sorted(p.name for p in out.iterdir()) == ["00_first.html", "01_second.html",
                                                      "index.html"]  # no stale page left


@pytest.mark.slow
def test_pages_link_the_contents_their_neighbours_and_chapters_by_page(book):
    _, out, _ = book
    first, second = (out / "00_first.html").read_text(), (out / "01_second.html").read_text()
    assert first.count('href="index.html"') == 2 and second.count('href="index.html"') == 2
    assert '<a href="01_second.html">01 · Second</a>' in first  # next
    assert '<a href="00_first.html">00 · First</a>' in second  # previous
    assert '<a href="01_second.html">the second</a>' in first  # the markdown's own link
    assert "a file outside" in first and "../docs/lab.md" not in first  # no dead link
    assert '<a href="https://example.org">the web</a>' in first


@pytest.mark.slow
def test_widgets_are_embedded_with_their_state(book):
    _, out, _ = book
    page = (out / "00_first.html").read_text()
    assert 'type="application/vnd.jupyter.widget-view+json"' in page
    state = page.split('type="application/vnd.jupyter.widget-state+json">', 1)[1]
    assert '"IntSliderModel"' in state.split("</script>", 1)[0]


@pytest.mark.slow
def test_the_source_notebooks_stay_stripped(book):
    course, _, sources = book
    assert {p.name: p.read_text() for p in course.glob("*.ipynb")} == sources


@pytest.mark.slow
def test_a_chapter_that_raises_builds_no_book_and_is_named(tmp_path):
    course, out = tmp_path / "course", tmp_path / "book"
    course.mkdir()
    _write(course, "00_fine.ipynb", v4.new_code_cell("print('fine')"))
    _write(course, "01_broken.ipynb", v4.new_code_cell("1 / 0"))
    built = _build(course, out)
    assert built.returncode != 0
    assert "01_broken.ipynb: a cell raised" in built.stderr
    assert "ZeroDivisionError" in built.stderr
    assert not out.exists() or not list(out.iterdir())


def test_a_saved_run_is_rendered_as_saved_without_running(tmp_path):
    course, out = tmp_path / "course", tmp_path / "book"
    course.mkdir()
    cell = v4.new_code_cell("raise SystemExit('rendering ran the cell')", execution_count=1,
                            outputs=[v4.new_output("stream", name="stdout", text="saved output\n")])
    _write(course, "00_saved.ipynb", v4.new_markdown_cell("# 00 · Saved"), cell)
    built = _build(course, out, "--executed")
    assert built.returncode == 0, built.stderr
    assert "saved output" in (out / "00_saved.html").read_text()


@pytest.mark.parametrize("cell, complaint", [
    (v4.new_code_cell("print('never run')"), "code cells [1] did not run"),
    (v4.new_code_cell("1 / 0", execution_count=1, outputs=[v4.new_output(
        "error", ename="ZeroDivisionError", evalue="division by zero", traceback=[])]),
     "cells [1] raised"),
])
def test_an_incomplete_saved_run_is_refused_by_name(tmp_path, cell, complaint):
    course, out = tmp_path / "course", tmp_path / "book"
    course.mkdir()
    _write(course, "00_partial.ipynb", v4.new_markdown_cell("# 00 · Partial"), cell)
    built = _build(course, out, "--executed")
    assert built.returncode != 0
    assert "00_partial.ipynb is not a complete run" in built.stderr and complaint in built.stderr


def test_a_folder_without_chapters_is_refused(tmp_path):
    built = _build(tmp_path, tmp_path / "book", "--executed")
    assert built.returncode != 0 and "no chapter notebooks (NN_name.ipynb)" in built.stderr


def test_make_book_builds_every_chapter_into_build_book():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^book: setup\n\t\$\(BIN\)/python scripts/build_book\.py$", makefile, re.M)
    assert re.search(r"^\.PHONY:.*\bbook\b", makefile, re.M)
    assert "build/" in (ROOT / ".gitignore").read_text().split()
