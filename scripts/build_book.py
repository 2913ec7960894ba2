"""Build the course as a book: a static HTML site, one page per chapter, with every output.

    python scripts/build_book.py                      # run every chapter, write build/book/
    python scripts/build_book.py --executed --course DIR --out OUT
                                                      # render chapters already run and saved
                                                      # (the browser test's JupyterLab copies)

Every chapter (``course/NN_*.ipynb``) is executed top to bottom by nbclient, in ``course/`` as
JupyterLab would run it; a cell that raises stops the build and names the chapter. The
repository's notebooks are read, never written. Pages are rendered by nbconvert's HTML exporter
with its ``lab`` template (JupyterLab's look); figures are embedded in the page as PNG data, so a
page is one file. ``index.html`` is the table of contents, followed by ``course/README.md`` (the
course map); every page links to the contents and to its neighbours.

Widgets: nbclient saves the widgets' state in the notebook, and the page embeds it; the Jupyter
widgets HTML manager draws them where the page can load it (from a CDN, like MathJax). Each of
the course's widgets sits beside a static figure of the same plot, which every reader sees.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parents[1]
CELL_TIMEOUT_S = 600  # as the notebook tests allow (tests/conftest.py)
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


def chapters(course: Path) -> list[Path]:
    """The chapter notebooks, in order: ``NN_name.ipynb``."""
    found = sorted(course.glob("[0-9][0-9]_*.ipynb"))
    if not found:
        raise ValueError(f"no chapter notebooks (NN_name.ipynb) in {course}")
    return found


def execute(path: Path) -> nbformat.NotebookNode:
    """Run the notebook top to bottom in its own folder; the file itself is left untouched."""
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except CellExecutionError as error:
        raise RuntimeError(f"{path.name}: a cell raised, the book is not built\n{error}") from None
    return notebook


def check_ran(notebook: nbformat.NotebookNode, name: str) -> None:
    """A page must show a whole run: every code cell executed, none ended in an error."""
    unrun = [i for i, cell in enumerate(notebook.cells)
             if cell.cell_type == "code" and cell.source.strip() and cell.execution_count is None]
    raised = [i for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"
              and any(output.output_type == "error" for output in cell.outputs)]
    if unrun or raised:
        raise ValueError(f"{name} is not a complete run: code cells {unrun} did not run, "
                         f"cells {raised} raised; expected every code cell run without error")


def title(notebook: nbformat.NotebookNode, name: str) -> str:
    """The first ``# heading`` of the notebook, else its file name."""
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return name


def page_name(notebook_name: str) -> str:
    return Path(notebook_name).with_suffix(".html").name


def book_links(markdown: str, names: set[str]) -> str:
    """Links to chapters point at their pages; other relative links (to files outside the
    book) keep only their text."""
    def relink(match: re.Match) -> str:
        text, target = match.groups()
        if target in names:
            return f"[{text}]({page_name(target)})"
        if re.match(r"[a-z]+:|#", target):
            return match.group(0)
        return text
    return LINK.sub(relink, markdown)


def navigation(titles: list[tuple[str, str]], i: int) -> nbformat.NotebookNode:
    """A markdown cell: the contents page, and the previous and next chapters."""
    parts = ["[Contents](index.html)"]
    if i > 0:
        parts.append(f"previous: [{titles[i - 1][1]}]({page_name(titles[i - 1][0])})")
    if i + 1 < len(titles):
        parts.append(f"next: [{titles[i + 1][1]}]({page_name(titles[i + 1][0])})")
    return nbformat.v4.new_markdown_cell(" · ".join(parts))


def contents(titles: list[tuple[str, str]], course_map: str) -> nbformat.NotebookNode:
    """The index page: one link per chapter, then the course map."""
    lines = ["# Contents", ""] + [f"- [{text}]({page_name(name)})" for name, text in titles]
    cells = [nbformat.v4.new_markdown_cell("\n".join(lines))]
    if course_map:
        cells.append(nbformat.v4.new_markdown_cell(course_map))
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["title"] = "Contents"
    return notebook


def build(course: Path, out: Path, executed: bool = False) -> list[Path]:
    """Write one page per chapter and ``index.html`` into ``out``; return the pages written.
    ``executed``: the notebooks in ``course`` already hold a complete run; render them."""
    paths = chapters(course)
    notebooks = {}
    for path in paths:
        start = time.perf_counter()
        notebooks[path.name] = nbformat.read(path, as_version=4) if executed else execute(path)
        check_ran(notebooks[path.name], path.name)
        print(f"{'read' if executed else 'ran'} {path.name} in {time.perf_counter() - start:.0f} s",
              flush=True)
    titles = [(name, title(notebook, name)) for name, notebook in notebooks.items()]
    exporter = HTMLExporter(template_name="lab")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.html"):  # a renamed or removed chapter leaves no old page
        stale.unlink()
    readme = course / "README.md"
    course_map = book_links(readme.read_text(), set(notebooks)) if readme.exists() else ""
    pages = [(out / "index.html", contents(titles, course_map))]
    for i, (name, notebook) in enumerate(notebooks.items()):
        for cell in notebook.cells:
            if cell.cell_type == "markdown":
                cell.source = book_links(cell.source, set(notebooks))
        notebook.cells = [navigation(titles, i), *notebook.cells, navigation(titles, i)]
        notebook.metadata["title"] = titles[i][1]
        pages.append((out / page_name(name), notebook))
    start = time.perf_counter()
    for page, notebook in pages:
        body, _ = exporter.from_notebook_node(notebook)
        page.write_text(body, encoding="utf-8")
    print(f"wrote {len(pages)} pages to {out} in {time.perf_counter() - start:.0f} s", flush=True)
    return [page for page, _ in pages]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--course", type=Path, default=ROOT / "course",
                        help="folder with the chapter notebooks (default: course/)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "book",
                        help="where the site goes (default: build/book/)")
    parser.add_argument("--executed", action="store_true",
                        help="the notebooks already hold a complete run: render, do not run")
    args = parser.parse_args(argv)
    try:
        build(args.course, args.out, args.executed)
    except (RuntimeError, ValueError) as error:
        sys.exit(f"build_book: {error}")


if __name__ == "__main__":
    main()
