"""The project's own files: dependencies in step, notebooks stripped, the README's commands real."""

from __future__ import annotations

import json
import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower()


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_environment_yml_names_the_same_dependencies_as_pyproject():
    project = _pyproject()["project"]
    wanted = {_name(r) for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        wanted |= {_name(r) for r in extra}
    env = (ROOT / "environment.yml").read_text()
    pip_section = env.split("- pip:", 1)[1]
    listed = {_name(line.strip()[2:]) for line in pip_section.splitlines()
              if line.strip().startswith("- ") and not line.strip().startswith("- -e")}
    assert listed == wanted
    assert "- -e ." in env  # the engine itself


def test_pyproject_and_environment_agree_on_versions():
    project = _pyproject()["project"]
    reqs = project["dependencies"] + [r for e in project["optional-dependencies"].values()
                                      for r in e]
    env = (ROOT / "environment.yml").read_text()
    for req in reqs:
        assert f"- {req.split(';')[0].strip()}" in env, f"{req} differs in environment.yml"


def test_the_setup_reuses_a_torch_that_meets_the_minimum():
    torch_req = next(r for r in _pyproject()["project"]["dependencies"] if _name(r) == "torch")
    minimum = tuple(int(x) for x in torch_req.split(">=")[1].split("."))
    makefile = (ROOT / "Makefile").read_text()
    assert f"sys.exit(v < {minimum})" in makefile
    assert "reuse-existing-torch.pth" in makefile


def test_notebooks_are_committed_without_outputs():
    notebooks = sorted((ROOT / "course").glob("*.ipynb"))
    assert notebooks, "no notebooks found in course/"
    for path in notebooks:
        nb = json.loads(path.read_text())
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] == "code":
                assert cell.get("outputs") == [], f"{path.name} cell {i} has outputs"
                assert cell.get("execution_count") is None, f"{path.name} cell {i} has a count"


def test_every_notebook_cell_has_a_unique_id():
    """nbformat 4.5 gives every cell an ``id``; a cell without one makes nbformat warn, and
    JupyterLab invents a new one on every save."""
    for path in sorted((ROOT / "course").glob("*.ipynb")):
        nb = json.loads(path.read_text())
        assert (nb["nbformat"], nb["nbformat_minor"]) >= (4, 5), path.name
        ids = [cell.get("id") for cell in nb["cells"]]
        missing = [i for i, cell_id in enumerate(ids) if not cell_id]
        assert not missing, f"{path.name}: cells {missing} have no id"
        assert len(set(ids)) == len(ids), f"{path.name}: two cells share an id"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make course" in readme and "make test" in readme
    assert "exec make test" in (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^test: setup$", (ROOT / "Makefile").read_text(), re.M)


def test_every_exercise_has_a_stub_a_solution_and_a_check():
    from engine.grading import registry

    for exercise in registry().values():
        stub = ROOT / "exercises" / f"{exercise.module}.py"
        solution = ROOT / "solutions" / f"{exercise.module}.py"
        assert stub.exists() and solution.exists(), exercise.name
        if exercise.attr:  # "" grades several functions of the module
            defines = re.compile(rf"^(def|class) {exercise.attr}\b", re.M)
            assert defines.search(stub.read_text()), exercise.name
            assert defines.search(solution.read_text()), exercise.name


def test_every_chapter_opens_with_what_you_learn_and_the_questions_it_answers():
    for path in sorted((ROOT / "course").glob("[0-9][0-9]_*.ipynb")):
        first = "".join(json.loads(path.read_text())["cells"][0]["source"])
        assert first.startswith("# "), f"{path.name}: the first cell is not the title"
        for heading in ("**You will learn**", "**Interview questions answered**"):
            assert heading in first, f"{path.name}: the first cell has no {heading}"


def test_the_course_map_gives_every_chapter_a_cpu_run_time():
    table = (ROOT / "course" / "README.md").read_text()
    for path in sorted((ROOT / "course").glob("[0-9][0-9]_*.ipynb")):
        row = next((line for line in table.splitlines() if f"]({path.name})" in line), None)
        assert row is not None, f"course/README.md does not list {path.name}"
        assert re.search(r"\| ~\d+ s \|", row), f"no CPU run time for {path.name}: {row}"


def _top_level_packages(pyproject: Path) -> set[str]:
    """The top-level packages setuptools would install from ``pyproject`` (its own discovery,
    run on the folder that holds the file, as a build does)."""
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    return {name.split(".")[0] for name in apply_configuration(Distribution(), pyproject).packages}


def test_the_distribution_installs_only_the_engine():
    packages = _top_level_packages(ROOT / "pyproject.toml")
    assert packages == {"engine"}, f"the wheel would add top-level packages {packages}"


def test_the_package_check_catches_a_top_level_tests_package(tmp_path):
    """The check above fails on the configuration this project used to have."""
    for name in ("engine", "exercises", "solutions", "tests", "README.md"):
        (tmp_path / name).symlink_to(ROOT / name)
    text, found = re.subn(r"^include = .*$",
                          'include = ["engine*", "exercises*", "solutions*", "tests*"]',
                          (ROOT / "pyproject.toml").read_text(), flags=re.M)
    assert found == 1
    (tmp_path / "pyproject.toml").write_text(text)
    assert _top_level_packages(tmp_path / "pyproject.toml") >= {"tests", "exercises"}


def test_the_grader_lives_in_the_engine_and_the_notebooks_use_it():
    assert not (ROOT / "tests" / "grading").exists()
    assert "python -m engine.grading" in (ROOT / "Makefile").read_text()
    for path in sorted((ROOT / "course").glob("*.ipynb")):
        text = path.read_text()
        assert "tests.grading" not in text, f"{path.name} imports the grader from tests"
