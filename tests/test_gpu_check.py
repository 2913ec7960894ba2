"""scripts/gpu_check.sh, checked on a CPU: offline, every command under a timeout, a summary
whatever happens (pytest's counts and each failure's first lines in it, the logs kept), its
rehearsal in an environment with only what the GPU lab image has; and the smoke checks of
scripts/gpu_smoke.py that a CPU can run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
SMOKE = ROOT / "scripts" / "gpu_smoke.py"

# What reaches for the network, or rebuilds the environment the check is meant to test.
NETWORK = ("make", "pip", "pip3", "uv", "conda", "mamba", "curl", "wget", "git", "apt",
           "apt-get")


def _commands() -> list[str]:
    """The script's logical lines (continuations joined, comments dropped)."""
    text = re.sub(r"\\\n\s*", " ", SCRIPT.read_text())
    lines = [line.split(" #")[0].strip() for line in text.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_the_script_never_sets_up_or_reaches_the_network():
    for line in _commands():
        code = re.sub(r"'[^']*'|\"[^\"]*\"", " ", line)  # what is said in strings is not run
        for word in re.split(r"[\s;|&()$`]+", code):
            assert word not in NETWORK, f"gpu_check.sh calls {word!r}: {line}"
        assert "-m pip" not in line and "http" not in line, line


def test_every_command_line_runs_under_timeout():
    """A line that runs Python, pytest, torchrun or nvidia-smi starts the program under
    `timeout`, or is a `run_step`, which runs its command under `timeout`."""
    body = SCRIPT.read_text()
    start = body.index("run_step() {")
    assert re.search(r'^\s*timeout --foreground -s INT -k \d+ "\$limit" "\$@"',
                     body[start:body.index("\n}\n", start)], re.M)
    invokes = re.compile(r'"\$(PY|candidate)" (?!\])|\bnvidia-smi\b|^(python3?|pytest|torchrun)\b')
    runs = [line for line in _commands() if invokes.search(line)]
    assert len(runs) >= 12  # the probes, collection, six smoke steps, two pytest runs
    for line in runs:  # gpu_step is run_step, or nothing in a rehearsal
        assert line.startswith(("run_step ", "gpu_step ")) or re.search(r"\btimeout\b", line), \
            line
    body = body.replace("\\\n", " ")
    assert re.search(r"^gpu_step\(\) \{\n(.*\n)*?\s+run_step \"\$@\"\n", body, re.M)


def test_pytest_runs_without_the_projects_plugin_options():
    """pyproject's addopts name nbval's options, which a pytest without nbval refuses."""
    options = next(line for line in _commands() if line.startswith("GPU_TESTS=("))
    assert '-o addopts=""' in options and "-p no:nbval" in options and "-m gpu" in options
    pytest_lines = [line for line in _commands() if '"$PY" -m pytest' in line]
    assert len(pytest_lines) == 3  # collection, tests/test_gpu.py, the others
    for line in pytest_lines:
        assert '-m pytest "${GPU_TESTS[@]}"' in line, line
    collect, first, rest = pytest_lines
    assert "--collect-only" in collect and collect.endswith(" tests")
    assert first.endswith(" tests/test_gpu.py") and "--ignore tests/test_gpu.py" in rest


# Stands in for Python: answers the script's probes (torch imports; one GPU) at once and hangs
# in every step, so each step can only time out.
_HANGING_PYTHON = """#!/usr/bin/env bash
case "$*" in
    *device_count*) echo 1 ;;
    -c*) ;;
    *) exec sleep 600 ;;
esac
"""

STEP_NAMES = ["environment", "collect the tests marked gpu", "tests/test_gpu.py",
              "NCCL at world size 1: engine.launch",
              "NCCL at world size 1: engine train --impl both",
              "Gloo with CUDA tensors, 3 ranks on one GPU", "forked Gloo ranks touching CUDA",
              "a CPU lesson on a GPU host stays on Gloo",
              "torchrun --nproc-per-node 2 on this machine", "the other tests marked gpu"]
NEEDS_A_GPU = {2, 3, 4, 5, 6, 9}  # the steps a rehearsal names but does not run


def _summary(stdout: str) -> list[tuple[str, ...]]:
    """``(status, step, what it saw)`` of each step (the lines under a step are indented)."""
    lines = stdout.split("== summary", 1)[1].splitlines()[1:]
    return [tuple(line.strip().split(" | ", 2)) for line in lines
            if re.match(r"  \S", line) and " | " in line]


def _run_script(tmp_path, *args, python, budget="290", timeout=100):
    env = dict(os.environ, GPU_CHECK_PYTHON=str(python), GPU_CHECK_BUDGET_S=budget,
               GPU_CHECK_LOGS=str(tmp_path / "logs"))
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.mark.timeout(120)
def test_a_step_that_times_out_still_ends_in_a_summary(tmp_path):
    """A 20 s budget and a Python that hangs: the first step is stopped by `timeout` when the
    budget runs out, the others are skipped, and the summary lists every step."""
    python = tmp_path / "python"
    python.write_text(_HANGING_PYTHON)
    python.chmod(0o755)
    done = _run_script(tmp_path, python=python, budget="20")
    summary = _summary(done.stdout)
    assert [step[1] for step in summary] == STEP_NAMES, done.stdout
    statuses = [step[0] for step in summary]
    assert statuses[0] == "PASS"
    assert re.fullmatch(r"TIMEOUT after \d+ s", statuses[1]), statuses
    assert statuses[2:] == ["SKIPPED"] * 8
    assert done.returncode == 1


@pytest.mark.timeout(120)
def test_an_interrupted_check_still_ends_in_a_summary(tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) part way through a step."""
    python = tmp_path / "python"
    python.write_text(_HANGING_PYTHON)
    python.chmod(0o755)
    env = dict(os.environ, GPU_CHECK_PYTHON=str(python), GPU_CHECK_BUDGET_S="290",
               GPU_CHECK_LOGS=str(tmp_path / "logs"))
    proc = subprocess.Popen(["bash", str(SCRIPT)], stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True,  # SIGINT's default action, even if
                            # this run inherited it ignored (tests.helpers.default_sigint)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _sleeping_under(proc.pid):
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    summary = _summary(out)
    assert summary[0][:2] == ("PASS", "environment")
    assert summary[-1] == ("INTERRUPTED", STEP_NAMES[1], "stopped by a signal"), out
    assert proc.returncode == 130


# Stands in for Python on a GPU machine where one test of tests/test_gpu.py fails: pytest's
# output as it writes it with -q -rfEs and CI set; every other step passes.
_FAILING_PYTHON = """#!/usr/bin/env bash
case "$*" in
    *device_count*) echo 1 ;;
    -c*) ;;
    *--collect-only*) printf 'tests/test_gpu.py::test_a\\ntests/test_x.py::test_b[cuda]\\n\\n'
                      echo '2/9 tests collected (7 deselected) in 0.50s' ;;
    *tests/test_gpu.py) cat <<'PYTEST_OUTPUT'
.F                                                                       [100%]
=================================== FAILURES ===================================
___________________________________ test_a ____________________________________

    def test_a():
>       assert launch_on_nccl() == 1, message
E       AssertionError: NCCL refused the tensor
E         second line
E       assert 0 == 1
E       + where 0 = launch_on_nccl()

tests/test_gpu.py:9: AssertionError
=========================== short test summary info ============================
FAILED tests/test_gpu.py::test_a - AssertionError: NCCL refused the tensor
  second line
1 failed, 1 passed, 5 deselected in 3.00s
PYTEST_OUTPUT
        exit 1 ;;
    *-m\\ pytest*) echo '1 passed, 8 deselected in 2.00s' ;;
    *) echo 'RESULT: fine' ;;
esac
"""


def test_pytest_counts_and_each_failures_first_lines_reach_the_summary(tmp_path):
    python = tmp_path / "python"
    python.write_text(_FAILING_PYTHON)
    python.chmod(0o755)
    done = _run_script(tmp_path, python=python)
    summary = _summary(done.stdout)
    assert [step[1] for step in summary] == STEP_NAMES, done.stdout
    assert summary[1][2] == ("2 tests collected, 1 of them in tests/test_gpu.py (pytest: 2/9 "
                             "tests collected (7 deselected) in 0.50s)")
    assert summary[2] == ("FAIL (exit 1)", "tests/test_gpu.py",
                          "1 failed, 1 passed, 5 deselected in 3.00s")
    assert summary[-1] == ("PASS", "the other tests marked gpu",
                           "1 passed, 8 deselected in 2.00s")
    assert [step[0] for step in summary].count("PASS") == len(STEP_NAMES) - 1
    under = done.stdout.split("| tests/test_gpu.py |", 1)[1].split("\n  PASS |", 1)[0]
    assert under.splitlines()[1:] == [
        "      FAILED tests/test_gpu.py::test_a - AssertionError: NCCL refused the tensor",
        "        test_a: AssertionError: NCCL refused the tensor",  # the error's first lines
        "        test_a: second line",
        "        test_a: assert 0 == 1"]
    assert done.returncode == 1
    [logs] = (tmp_path / "logs").iterdir()  # kept, named by the time, printed
    assert f"logs: {logs}" in done.stdout
    summary_file = (logs / "summary.txt").read_text()
    assert summary_file.strip() == "== summary" + done.stdout.split("== summary", 1)[1].rstrip()
    assert len(list(logs.glob("*.log"))) == len(STEP_NAMES) - 1  # one per step that ran


# -- the rehearsal, in an environment with only what the GPU lab image has --------------------

LAB_IMAGE = ("torch", "numpy", "pytest", "pytest-timeout", "matplotlib", "tqdm")


def _requirements(names) -> dict:
    """The distributions ``names`` need to run, theirs included (extras left out)."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement

    found, todo = {}, list(names)
    while todo:
        dist = distribution(todo.pop())
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key not in found:
            found[key] = dist
            todo += [req.name for req in map(Requirement, dist.requires or [])
                     if req.marker is None or req.marker.evaluate({"extra": ""})]
    return found


def lab_image_python(where: Path) -> Path:
    """A Python with only the lab image's packages: a venv (no pip, no system site-packages)
    whose site-packages holds links to the files of torch, numpy, pytest, pytest-timeout,
    matplotlib, tqdm and of what they require, taken from this environment (the same
    versions, nothing copied, about a second). Their ``*.dist-info`` come along, so pytest
    loads the plugins the lab image would load (pytest-timeout) and no other (nbval)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    [site] = where.glob("lib/python*/site-packages")
    for dist in _requirements(LAB_IMAGE).values():
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            source = Path(dist.locate_file(top))
            if top not in ("..", "__pycache__") and not top.endswith(".pth") and \
                    source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
    return where / "bin" / "python"


@pytest.mark.timeout(300)
def test_the_rehearsal_runs_with_only_the_lab_images_packages(tmp_path):
    """Issue 30's acceptance: in an environment with only torch, numpy, pytest, pytest-timeout,
    matplotlib and tqdm (:func:`lab_image_python`: a real venv, so what is not there cannot
    be imported, by the script, pytest, its plugins or the ranks it starts),
    ``gpu_check.sh --rehearse`` exits 0, collects every test marked gpu (as many as this
    project's own environment, nbval and the notebook packages included, collects) and prints
    the summary with pytest's counts. About 40 s on two busy cores."""
    suite = subprocess.Popen([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m",
                              "gpu", "tests"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    python = lab_image_python(tmp_path / "lab")
    missing = subprocess.run([python, "-c", "import nbformat"], capture_output=True, text=True)
    assert "No module named 'nbformat'" in missing.stderr  # no notebook packages there
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(["bash", str(SCRIPT), "--rehearse"], capture_output=True, text=True,
                          env=dict(env, GPU_CHECK_PYTHON=str(python),
                                   GPU_CHECK_LOGS=str(tmp_path / "logs")), timeout=240)
    in_the_suite = sum(line.startswith("tests/") and "::" in line
                       for line in suite.communicate(timeout=120)[0].splitlines())
    assert done.returncode == 0, done.stdout + done.stderr
    summary = _summary(done.stdout)
    assert [step[1] for step in summary] == STEP_NAMES, done.stdout
    for i, (status, name, saw) in enumerate(summary):
        assert status == ("NOT RUN" if i in NEEDS_A_GPU else "PASS"), (name, saw)
    assert summary[0][2] == f"{python} sees 0 GPU(s)"
    collected = re.fullmatch(r"(\d+) tests collected, (\d+) of them in tests/test_gpu.py "
                             r"\(pytest: (\d+)/\d+ tests collected \(\d+ deselected\) "
                             r"in [\d.]+s\)", summary[1][2])
    assert collected, summary[1]
    assert int(collected[1]) == int(collected[3]) == in_the_suite > 0
    assert int(collected[2]) == 6  # the tests of tests/test_gpu.py, which run first on a GPU
    assert "Gloo" in summary[7][2] and "NCCL refused on every rank" in summary[8][2]


def _sleeping_under(pid: int) -> bool:
    """True once the script's first step (the hanging stand-in) is running."""
    from tests.helpers import descendants

    return any(Path(f"/proc/{p}/comm").read_text().strip() == "sleep" for p in descendants(pid)
               if Path(f"/proc/{p}/comm").exists())


def _smoke(*argv, timeout=120):
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_smoke_cpu_lesson_runs_on_gloo():
    done = _smoke(str(SMOKE), "cpu-lesson")
    assert done.returncode == 0, done.stderr
    assert "RESULT: a notebook-style launch with 0 GPU(s) visible ran on Gloo" in done.stdout


@pytest.mark.timeout(180)
def test_smoke_torchrun_on_a_machine_with_too_few_gpus():
    done = _smoke("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  str(SMOKE), "torchrun", timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT: ")]
    assert len(results) == 1  # printed by global rank 0 only
    assert "default -> Gloo on every rank; NCCL refused on every rank" in results[0]


def _load_smoke():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_smoke", SMOKE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _smoke_backend_under_nccl_rules(rank, world_size):
    from engine.observe.nccl_rules import nccl_rules

    with nccl_rules("cpu"):  # a tensor made without a device is refused, as NCCL would
        try:
            return _load_smoke()._backend(rank, world_size)
        except ValueError as e:
            return str(e)


def test_smoke_torchrun_check_hands_nccl_a_tensor_on_the_ranks_device():
    """gpu_smoke's torchrun check all-reduces on NCCL where there are GPUs enough: its tensor
    must be on the rank's GPU (engine.launch.device.rank_device), not where torch.ones puts it."""
    from tests.helpers import run_ranks

    assert run_ranks(_smoke_backend_under_nccl_rules, 2) == [("gloo", 2.0)] * 2
