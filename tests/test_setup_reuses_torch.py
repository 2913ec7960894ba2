"""`make setup` with an interpreter that already has torch reuses it and installs no other."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_setup_reuses_the_torch_the_interpreter_already_has(tmp_path):
    venv = tmp_path / "venv"
    done = subprocess.run(["make", "setup", f"PYTHON={sys.executable}", f"VENV={venv}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "reusing the torch" in done.stdout
    seen = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import torch, engine; print(torch.__file__)"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert seen == torch.__file__  # the very same installation, not a copy
    assert not list(venv.glob("lib/python*/site-packages/torch"))  # nothing new installed
