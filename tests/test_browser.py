"""The course as a learner sees it: real JupyterLab in headless Chromium, every chapter run
from the Run menu, widgets rendered and redrawn, no errors in cells or in the console. Each
chapter is saved once it has run (with its widgets' state), and the book
(``scripts/build_book.py --executed``) is built from those runs into ``test-artifacts/book/``:
the last test opens it and checks that every chapter page shows its figures, so the book costs
CI no third run of the chapters.

Playwright drives Debian's Chromium (``/usr/bin/chromium``). Where it is missing, the test
installs it with apt when it can (root, apt-get present), with a CJK font so the drill's
Chinese lines render in the screenshots; where it cannot, the test is skipped with the reason.
Screenshots go to ``test-artifacts/browser/``, taken also when a chapter fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts" / "browser"
BOOK = ROOT / "test-artifacts" / "book"
CHAPTERS = sorted(p.name for p in (ROOT / "course").glob("[0-9][0-9]_*.ipynb"))
# notebooks with sliders whose figure must redraw, and the explorer to move
WIDGETS = {"01_collectives.ipynb": 2, "02_data_parallel.ipynb": 1, "04_zero.ipynb": 1,
           "06_pipeline.ipynb": 1, "07_3d_parallelism.ipynb": 1, "08_interview_drill.ipynb": 1}
IGNORED_CONSOLE = ("favicon", "Failed to load resource: the server responded with a status of "
                   "404")


APT_PACKAGES = {"chromium": "chromium", "fonts-wqy-microhei": "WenQuanYi Micro Hei"}


def _missing_packages() -> list[str]:
    fonts = subprocess.run(["fc-list"], capture_output=True, text=True).stdout \
        if shutil.which("fc-list") else ""
    return [package for package, name in APT_PACKAGES.items()
            if not (shutil.which(name) if package == "chromium" else name in fonts)]


def _apt_install(packages: list[str]) -> str:
    """Install with apt; on failure refresh the package lists once and retry. The last
    error, or '' on success."""
    error = ""
    for refresh in (False, True):
        if refresh:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=600)
        done = subprocess.run(["apt-get", "install", "-y", "-q", *packages],
                              capture_output=True, text=True, timeout=900)
        if done.returncode == 0:
            return ""
        error = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["failed"]
        error = error[0]
    return error


def _chromium() -> str:
    missing = _missing_packages()
    error = ""
    if missing and os.name == "posix" and os.geteuid() == 0 and shutil.which("apt-get"):
        error = _apt_install(missing)
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    pytest.skip("Chromium is not installed and could not be installed here "
                + (f"(apt-get: {error})" if error else "(needs root and apt-get)")
                + ": the browser test needs Debian's chromium package")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A copy of the chapters for JupyterLab to run and save: the repository's stay stripped."""
    served = tmp_path_factory.mktemp("served")
    shutil.copytree(ROOT / "course", served / "course",
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    return served


@pytest.fixture(scope="module")
def lab(served, tmp_path_factory):
    """A JupyterLab server on loopback serving the copy, news and update checks off, saving
    the widgets' state with a notebook (for the book)."""
    settings = tmp_path_factory.mktemp("lab-settings")
    workspaces = tmp_path_factory.mktemp("lab-workspaces")
    for plugin, values in (("@jupyterlab/apputils-extension/notification",
                            {"fetchNews": "false", "checkForUpdates": False}),
                           ("@jupyter-widgets/jupyterlab-manager/plugin", {"saveState": True})):
        folder, name = plugin.rsplit("/", 1)
        (settings / folder).mkdir(parents=True)
        (settings / folder / f"{name}.jupyterlab-settings").write_text(json.dumps(values))
    port, token = _free_port(), "browser-test"
    jupyter = Path(sys.executable).with_name("jupyter")
    log = open(tmp_path_factory.mktemp("lab-log") / "lab.log", "w")
    process = subprocess.Popen(
        [str(jupyter), "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={served}", f"--LabApp.user_settings_dir={settings}",
         f"--LabApp.workspaces_dir={workspaces}",
         "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: open a chapter in place
         "--allow-root"], stdout=log, stderr=subprocess.STDOUT, cwd=served)
    try:
        for _ in range(120):
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("JupyterLab did not start")
        yield f"http://127.0.0.1:{port}", token
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture(scope="module")
def browser():
    executable = _chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        instance = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield instance
        instance.close()


PROMPTS = """() => [...document.querySelectorAll(
        '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-CodeCell .jp-InputPrompt')]
    .map(prompt => prompt.textContent.trim())"""
# Run All shows [*] on every queued cell; when none is left the run is over, finished or
# stopped by a cell that raised (JupyterLab then drops the rest of the queue).
RUN_OVER = """() => { const cells = document.querySelectorAll(
        '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-CodeCell .jp-InputPrompt');
    return cells.length > 0 && ![...cells].some(p => p.textContent.includes('*')); }"""


# How often a wait re-reads the page or the file: a query of a few hundred prompts costs the
# browser well under a millisecond, and each wait otherwise ends on average half a period late
# (13 chapters, several waits each).
POLL_MS = 200

STARTED = """() => [...document.querySelectorAll(
        '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-CodeCell .jp-InputPrompt')]
    .some(prompt => /\\[(\\*|\\d+)\\]/.test(prompt.textContent))"""


# The current notebook is this chapter and its kernel is idle (JupyterLab's own objects).
KERNEL_IDLE = """path => { const w = window.jupyterapp.shell.currentWidget;
    const kernel = w && w.sessionContext && w.sessionContext.session
                   && w.sessionContext.session.kernel;
    return !!kernel && w.context.path === path && kernel.status === 'idle'; }"""
# Close every tab (each saved and clean: see _reusable), then open the chapter in the same app.
OPEN_IN_PLACE = """async path => { const commands = window.jupyterapp.commands;
    await commands.execute('application:close-all');
    await commands.execute('docmanager:open', {path}); }"""


def _reusable(page) -> bool:
    """A page whose last chapter passed: JupyterLab loaded, no unsaved tab (closing one would
    ask to save it). Loading JupyterLab again costs 3 s of a quiet 2-core machine per chapter,
    8 s of a busy one (measured), so the next chapter opens in it."""
    return page is not None and not page.is_closed() and page.evaluate(
        "() => !!window.jupyterapp && !document.querySelector('.lm-TabBar-tab.jp-mod-dirty')")


def _open_and_run(page, url, token, chapter, in_place=False):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    if in_place:  # the JupyterLab of the previous chapter: only this notebook open in it
        page.evaluate(OPEN_IN_PLACE, f"course/{chapter}")
        page.wait_for_function(KERNEL_IDLE, arg=f"course/{chapter}", timeout=120_000,
                               polling=POLL_MS)
    else:  # a workspace of its own, reset: only this notebook is open
        page.goto(f"{url}/lab/workspaces/{chapter[:2]}/tree/course/{chapter}?reset&token={token}")
        page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell",
                               timeout=120_000)
        page.wait_for_function("() => document.body.innerText.includes('Idle')",
                               timeout=120_000)
    # Run All queues every cell at once ([*]). On a cold server a click can land before the
    # notebook is wired to its kernel and do nothing: then click once more.
    for attempt in range(2):
        page.click("div.lm-MenuBar-itemLabel:text-is('Run')")
        page.click("text=Run All Cells")
        try:
            page.wait_for_function(STARTED, timeout=60_000, polling=POLL_MS)
            break
        except PlaywrightTimeout:
            if attempt:
                raise AssertionError(f"{chapter}: Run All Cells started no cell in 60 s, "
                                     "twice") from None
    page.wait_for_function(RUN_OVER, timeout=800_000, polling=POLL_MS)


# chapters this module ran in JupyterLab, and those of them saved with their outputs
RAN, SAVED = set(), set()


def _save(page, served, chapter):
    """Save the notebook from the File menu; wait until its tab is clean and the file written.
    (Whether the saved run is complete, build_book.py checks.)"""
    path = served / "course" / chapter
    before = path.stat().st_mtime_ns
    page.click("div.lm-MenuBar-itemLabel:text-is('File')")
    page.click(".lm-Menu-itemLabel:text-is('Save Notebook')")
    page.wait_for_function("() => !document.querySelector('.lm-TabBar-tab.jp-mod-dirty')",
                           timeout=60_000, polling=POLL_MS)
    for _ in range(60_000 // POLL_MS):
        if path.stat().st_mtime_ns != before:
            SAVED.add(chapter)
            return
        time.sleep(POLL_MS / 1000)
    raise AssertionError(f"{chapter}: Save Notebook did not write the file in 60 s")


@pytest.fixture(scope="module")
def pages(browser):
    """The page the chapters run in, one after another; a chapter that fails takes it down
    with it, and the next one starts a page of its own."""
    held = {"page": None}
    yield held
    if held["page"] is not None and not held["page"].is_closed():
        held["page"].close()


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_chapter_runs_in_jupyterlab_and_its_widgets_work(lab, served, browser, pages,
                                                                chapter):
    url, token = lab
    page, in_place = pages["page"], _reusable(pages["page"])
    if not in_place:
        if page is not None and not page.is_closed():
            page.close()
        page = pages["page"] = browser.new_page(viewport={"width": 1400, "height": 1000})
    console = []
    on_console = lambda m: console.append(m.text) if m.type == "error" else None  # noqa: E731
    on_error = lambda e: console.append(f"page error: {e}")  # noqa: E731
    page.on("console", on_console)
    page.on("pageerror", on_error)
    try:
        _run_and_check(page, url, token, chapter, console, served, in_place)
    except BaseException:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"{chapter[:-6]}-FAILED.png"), full_page=False)
        page.close()
        raise
    finally:
        if not page.is_closed():
            page.remove_listener("console", on_console)
            page.remove_listener("pageerror", on_error)


def _run_and_check(page, url, token, chapter, console, served, in_place=False):
    """Run and save the chapter; assert no cell raised, its widgets rendered, a slider redraws
    its figure (chapters 01, 04, 06), and the console stayed clean; screenshot it."""
    RAN.add(chapter)
    _open_and_run(page, url, token, chapter, in_place)
    _save(page, served, chapter)
    # textContent, not innerText: JupyterLab lays out only the cells near the viewport, and
    # innerText of the others is empty.
    stderr = [o.text_content() or "" for o in page.query_selector_all(
        ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")]
    errors = [text for text in stderr if "Traceback" in text or "Error" in text.split("\n")[0]]
    assert not errors, f"{chapter}: a cell raised:\n{errors[0][:2000]}"
    prompts = page.evaluate(PROMPTS)
    unrun = [i for i, prompt in enumerate(prompts) if not re.search(r"\[\d+\]", prompt)]
    assert not unrun, f"{chapter}: code cells {unrun} did not run (prompts {prompts})"
    expected = WIDGETS.get(chapter, 0)
    widgets = page.query_selector_all(".jp-OutputArea-output .jupyter-widgets")
    assert len(widgets) >= expected, f"{chapter}: {len(widgets)} widgets rendered"
    if chapter in ("04_zero.ipynb", "06_pipeline.ipynb", "01_collectives.ipynb"):
        _slider_redraws_its_figure(page, chapter)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{chapter[:-6]}.png"), full_page=False)
    real = [m for m in console if not any(s in m for s in IGNORED_CONSOLE)]
    assert not real, f"{chapter}: JavaScript console errors: {real[:5]}"


def _slider_redraws_its_figure(page, chapter):
    """Move the last interactive widget's first slider; its figure must change."""
    boxes = page.query_selector_all(".widget-interact")
    assert boxes, f"{chapter}: no interactive widget"
    box = boxes[-1]
    box.scroll_into_view_if_needed()
    image = box.query_selector(".jp-OutputArea-output img")
    assert image is not None, f"{chapter}: the widget shows no figure"
    before = image.get_attribute("src")
    handle = box.query_selector(".widget-slider .noUi-handle")
    assert handle is not None, f"{chapter}: the widget has no slider"
    handle.focus()
    page.keyboard.press("ArrowRight")
    page.wait_for_function(
        """([el, before]) => { const img = el.querySelector('.jp-OutputArea-output img');
                               return img && img.getAttribute('src') !== before; }""",
        arg=[box, before], timeout=60_000)
    # the redrawn figure decoded (not a fixed pause) before the screenshot
    page.wait_for_function(
        """el => { const img = el.querySelector('.jp-OutputArea-output img');
                   return img && img.complete && img.naturalWidth > 0; }""",
        arg=box, timeout=60_000)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    box.screenshot(path=str(ARTIFACTS / f"{chapter[:-6]}-widget.png"))


def _figures_in_run(notebook: dict) -> int:
    """Figures among the outputs the run saved (widgets' own outputs live in their state)."""
    return sum(1 for cell in notebook["cells"] if cell["cell_type"] == "code"
               for output in cell["outputs"]
               if {"image/png", "image/svg+xml"} & set(output.get("data", {})))


def _draws(notebook: dict) -> bool:
    return any("plt." in "".join(cell["source"]) for cell in notebook["cells"]
               if cell["cell_type"] == "code")


# loaded figures outside widgets (where the widgets' renderer loads, they draw their own too)
PAGE_FIGURES = """() => [...document.querySelectorAll('.jp-OutputArea-output img')]
    .filter(img => !img.closest('.jupyter-widgets') && img.complete && img.naturalWidth > 0)
    .length"""
PAGE_OUTPUTS = """() => [...document.querySelectorAll('.jp-OutputArea-output')]
    .filter(o => o.textContent.trim() || o.querySelector('img')).length"""


@pytest.mark.timeout(2400)  # also runs, unchecked, the chapters left out by -k (up to 11 runs)
def test_the_book_built_from_these_runs_shows_every_chapters_figures(lab, served, browser):
    """Build the book from the notebooks JupyterLab ran and saved above; open it as a reader
    would (file://, no server): the contents link every chapter, and each chapter page shows
    every figure its run drew (loaded, not broken), and its outputs. Offline, only the CDN
    scripts (MathJax, the widgets' HTML manager) fail to load; no script raises."""
    failed = sorted(RAN - SAVED)
    assert not failed, f"the book needs every chapter's run; these did not run or save: {failed}"
    url, token = lab
    for chapter in CHAPTERS:  # chapters deselected above: run and save them here
        if chapter not in SAVED:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            _open_and_run(page, url, token, chapter)
            _save(page, served, chapter)
            page.close()
    shutil.rmtree(BOOK, ignore_errors=True)
    built = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_book.py"),
                            "--executed", "--course", str(served / "course"), "--out", str(BOOK)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, f"the book did not build:\n{built.stdout}\n{built.stderr}"

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    problems = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error"
            and not m.text.startswith("Failed to load resource") else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.goto((BOOK / "index.html").as_uri())
    links = page.evaluate("() => [...document.querySelectorAll('a')].map(a => a.href)")
    unlinked = [c for c in CHAPTERS if (BOOK / c).with_suffix(".html").as_uri() not in links]
    assert not unlinked, f"the book's contents do not link {unlinked}"
    page.screenshot(path=str(ARTIFACTS / "book-index.png"))
    for chapter in CHAPTERS:
        run = json.loads((served / "course" / chapter).read_text())
        expected = _figures_in_run(run)
        assert expected or not _draws(run), f"{chapter}: the run saved no figure"
        page.goto((BOOK / chapter).with_suffix(".html").as_uri())
        shown = page.evaluate(PAGE_FIGURES)
        assert shown == expected, f"{chapter}: the book page shows {shown} of {expected} figures"
        assert page.evaluate(PAGE_OUTPUTS) > 0, f"{chapter}: the book page shows no output"
        first = page.query_selector(".jp-OutputArea-output img") \
            or page.query_selector(".jp-OutputArea-output")
        first.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / f"book-{chapter[:-6]}.png"))
    page.close()
    assert not problems, f"the book's pages raised in the browser: {problems[:5]}"
