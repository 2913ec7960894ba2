#!/usr/bin/env bash
# The GPU checks, for a lent GPU machine or a classroom lab box: the tests marked `gpu`.
set -euo pipefail
cd "$(dirname "$0")/.."
make setup >/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv || true
.venv/bin/python -m pytest -m gpu -v tests/test_gpu.py tests/test_memory.py "$@"
