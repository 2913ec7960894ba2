#!/usr/bin/env bash
# One short GPU check for a lab machine (or a lent GPU): the tests marked `gpu`, then a short
# `engine train` benchmark against PyTorch's own DDP, then a summary. About 5 minutes on one GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
make setup >/dev/null || exit 1
echo "== GPUs"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
echo "== tests marked gpu"
# every strategy's equivalence on CUDA (NCCL at world size 1, Gloo with CUDA tensors at 3 ranks
# on one GPU, NCCL where there are enough GPUs), and the NCCL trainer and memory checks
timeout 270 .venv/bin/python -m pytest -m gpu -q -rs -p no:cacheprovider tests
tests=$?
echo "== engine train, one GPU, NCCL, engine vs torch DDP"
timeout 120 .venv/bin/python -m engine train --world-size 1 --backend nccl --model medium \
    --steps 10 --zero 0 --impl both
train=$?
echo "== summary: gpu tests exit $tests, engine train exit $train"
exit $(( tests || train ))
