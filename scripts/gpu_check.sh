#!/usr/bin/env bash
# The GPU check for a lab machine (or a lent GPU), offline, in about 5 minutes on one GPU:
# the smoke checks of scripts/gpu_smoke.py, the NCCL trainer, a torchrun launch, then the tests
# marked gpu with whatever time is left, and a summary of every step, even one that timed out.
#
# It uses an environment prepared beforehand and never the network: .venv if it is there (what
# `make setup` made), else the first of python3 / python that imports torch, or the interpreter
# named by GPU_CHECK_PYTHON. Every step runs under `timeout`; GPU_CHECK_BUDGET_S (default 290)
# bounds the whole run. Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's engine, installed or not
BUDGET_S=${GPU_CHECK_BUDGET_S:-290}
LOGS=$(mktemp -d)
STEPS=()     # "status | name | what it saw", in order
FAILED=0

summary() {
    echo
    echo "== summary ($SECONDS s of a $BUDGET_S s budget; python: ${PY:-none})"
    local line
    for line in "${STEPS[@]}"; do echo "  $line"; done
    rm -rf "$LOGS"
}
trap summary EXIT
trap 'record INTERRUPTED "${CURRENT:-gpu_check.sh}" "stopped by a signal"; exit 130' INT TERM

record() {  # record STATUS NAME [WHAT IT SAW]
    STEPS+=("$1 | $2${3:+ | $3}")
    [ "$1" = PASS ] || FAILED=1
}

# run_step NAME SECONDS COMMAND...: COMMAND under `timeout`, at most SECONDS and never past the
# budget. SIGINT first, so Python (and pytest) stop their ranks and print what they have; in the
# foreground, so a Ctrl-C reaches the step too (ranks that engine.launch started die with it).
run_step() {
    local name=$1 cap=$2 left limit log rc status
    shift 2
    left=$(( BUDGET_S - SECONDS ))
    if (( left < 15 )); then
        record SKIPPED "$name" "no time left in the budget"
        return
    fi
    limit=$(( cap < left ? cap : left ))
    log="$LOGS/step${#STEPS[@]}.log"
    CURRENT=$name
    echo
    echo "== $name (at most $limit s)"
    timeout --foreground -s INT -k 15 "$limit" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    case $rc in
        0) status=PASS ;;
        124 | 137) status="TIMEOUT after $limit s" ;;
        *) status="FAIL (exit $rc)" ;;
    esac
    record "$status" "$name" "$(grep -h '^RESULT: ' "$log" | tail -n 1 | cut -c 9-)"
    CURRENT=""
}

# -- the environment: one that exists already, never the network ------------------------------

PY=""
for candidate in "${GPU_CHECK_PYTHON:-}" .venv/bin/python python3 python; do
    [ -n "$candidate" ] || continue
    if timeout 60 "$candidate" -c 'import torch' >/dev/null 2>&1; then
        PY=$candidate
        break
    fi
done
if [ -z "$PY" ]; then
    record FAIL "environment" "no python with torch: run make setup first (needs the network)"
    exit 2
fi
echo "== environment"
timeout 60 "$PY" -c 'import sys, torch; print(sys.executable, "torch", torch.__version__)'
GPUS=$(timeout 60 "$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)
case $GPUS in '' | *[!0-9]*) GPUS=0 ;; esac
echo "CUDA GPUs visible to torch: $GPUS"
timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
if (( GPUS < 1 )); then
    record FAIL "environment" "this python sees no CUDA GPU (a CPU build of torch?)"
    exit 2
fi
record PASS "environment" "$PY sees $GPUS GPU(s)"

# -- smoke checks: what one GPU can show, each in its own fresh process -------------------------

run_step "NCCL at world size 1: engine.launch" 60 "$PY" scripts/gpu_smoke.py nccl-1
run_step "NCCL at world size 1: engine train --impl both" 90 \
    "$PY" -m engine train --world-size 1 --backend nccl --model medium --steps 5 --zero 0 \
    --impl both
run_step "Gloo with CUDA tensors, 3 ranks on one GPU" 60 "$PY" scripts/gpu_smoke.py gloo-cuda-3
run_step "forked Gloo ranks touching CUDA" 60 "$PY" scripts/gpu_smoke.py forked-cuda
run_step "a CPU lesson on a GPU host stays on Gloo" 40 "$PY" scripts/gpu_smoke.py cpu-lesson
run_step "torchrun --nproc-per-node 2 on this machine" 60 \
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 scripts/gpu_smoke.py torchrun

# -- the tests marked gpu, with the time that is left ------------------------------------------
# -o addopts="" drops the project's nbval options, so pytest runs with or without its plugins
# (pytest-timeout, nbval); without pytest-timeout its ini option only warns.

if timeout 60 "$PY" -c 'import pytest' >/dev/null 2>&1; then
    run_step "tests marked gpu" 600 "$PY" -m pytest -o addopts="" -p no:cacheprovider -m gpu \
        -q -rfEs tests
else
    record SKIPPED "tests marked gpu" "pytest is not installed in $PY"
fi

exit $FAILED
