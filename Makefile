# The course's two commands (see README.md):
#   make course   set up .venv and open JupyterLab on the course
#   make test     set up .venv and run every test: engine tests, notebooks (nbval), grader checks
#   make book     run every chapter and write the course as a static site to build/book/
# Variables: PYTHON (the interpreter to build the venv from), TORCH_SPEC (the torch to install
# when PYTHON has no torch >= 2.4 of its own), PYTEST_ARGS, JUPYTER_ARGS (e.g. --no-browser).

PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
BIN         := $(VENV)/bin
STAMP       := $(VENV)/.installed
ROOT_FLAG   := $(if $(filter 0,$(shell id -u)),--allow-root)  # Jupyter refuses root without it
HAS_TORCH   := import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 4))

.PHONY: course test grade book bench setup clean

setup: $(STAMP)

# An existing torch >= 2.4 is reused, never replaced: a .pth file puts the site-packages that
# holds it on the venv's path (after the venv's own), which works whether PYTHON is a system,
# conda or venv interpreter. Without one the venv is isolated and gets TORCH_SPEC.
$(STAMP): pyproject.toml
	@if $(PYTHON) -c '$(HAS_TORCH)' 2>/dev/null; then \
	    echo "setup: reusing the torch that $(PYTHON) already has"; \
	    $(PYTHON) -m venv $(VENV) && \
	    $(PYTHON) -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' \
	        > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/reuse-existing-torch.pth" && \
	    $(BIN)/python -c '$(HAS_TORCH)' || { echo "setup: the venv cannot see that torch"; exit 1; }; \
	else \
	    echo "setup: creating $(VENV) and installing $(TORCH_SPEC)"; \
	    $(PYTHON) -m venv $(VENV) && \
	    ( $(BIN)/python -c '$(HAS_TORCH)' 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)" ); \
	fi
	$(BIN)/pip install -q -e ".[test]"
	@# torchft (chapter 11's real system, the extra "ft") only beside the torch already there:
	@# pinned to its version, so it never replaces it; where it cannot, its test is skipped.
	@v=$$($(BIN)/python -c 'import torch; print(torch.__version__.split("+")[0])'); \
	if $(BIN)/pip install -q -e ".[ft]" "torch==$$v" >/dev/null 2>&1; then \
	    echo "setup: torchft installed beside torch $$v (chapter 11's comparison)"; \
	else \
	    echo "setup: torchft not installed beside torch $$v (it needs torch >= 2.7 on Linux); its comparison test is skipped"; \
	fi
	@# bubblewrap: the grader's sandbox for a class's submissions (engine/grading/sandbox.py).
	@# Installed with Debian's apt where this runs as root; elsewhere the grader says it runs
	@# with limits only (README's "Grading a class" says what each mode stops).
	@if command -v bwrap >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    ( apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; } ) \
	    && echo "setup: bubblewrap installed (the grader's sandbox)" \
	    || echo "setup: bubblewrap could not be installed; the grader will grade with limits only"; \
	else echo "setup: no bubblewrap (apt-get install bubblewrap, as root): the grader will grade with limits only"; fi
	@touch $(STAMP)

course: setup
	$(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.root_dir=. $(ROOT_FLAG) $(JUPYTER_ARGS) \
	    course/00_setup.ipynb

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# make grade ARGS="--root students/alice --only ch09 --junit alice.xml": any option of
# python -m engine.grading (later options win over the default --junit)
grade: setup
	$(BIN)/python -m engine.grading --junit grade-report.xml $(ARGS)

book: setup
	$(BIN)/python scripts/build_book.py

bench: setup
	$(BIN)/python benchmarks/launch.py
	$(BIN)/python benchmarks/collectives.py
	$(BIN)/python benchmarks/dp.py
	$(BIN)/python benchmarks/compression.py
	$(BIN)/python benchmarks/zero.py
	$(BIN)/python benchmarks/fsdp2.py
	$(BIN)/python benchmarks/pipeline.py
	$(BIN)/python benchmarks/compose.py

clean:
	rm -rf $(VENV) grade-report.xml
