#!/usr/bin/env bash
# The GPU check for a lab machine (or a lent GPU), offline, in about 8 minutes on one GPU:
# the tests of tests/test_gpu.py first, the smoke checks of scripts/gpu_smoke.py, the NCCL
# trainer, a torchrun launch, then every other test marked gpu with the time that is left, and a
# summary of every step (pytest's closing counts and each failure's first lines included), even
# of one that timed out.
#
#   scripts/gpu_check.sh              on the GPU machine
#   scripts/gpu_check.sh --rehearse   on a machine without a GPU: the environment, the
#                                     collection of every GPU test, the smoke checks a CPU can
#                                     run, and the same summary (exit 0 when those pass)
#
# It needs only what the lab image has (torch, numpy, pytest, pytest-timeout, matplotlib, tqdm
# and the standard library) and never the network: .venv if it is there (what `make setup`
# made), else the first of python3 / python that imports torch, or the interpreter named by
# GPU_CHECK_PYTHON. Every step runs under `timeout`, at most its cap; GPU_CHECK_BUDGET_S
# (default 540, under a lent machine's 10 minutes) bounds the whole run: the caps of the steps
# before the last add up to 525 s, but they take about 3 minutes when nothing hangs, which
# leaves the last step (about 10 s a test, each spawns fresh ranks) 5 minutes. The logs of
# every step stay in gpu-check-logs/<UTC time>/ (or under GPU_CHECK_LOGS), printed at the start
# and the end. Exit status: 0 when every step that ran passed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's engine, installed or not
export CI=1  # pytest writes each failure's summary line whole, not cut to the terminal's width
case "${1:-}" in
    "") REHEARSE=0 ;;
    --rehearse) REHEARSE=1 ;;
    *) echo "usage: scripts/gpu_check.sh [--rehearse]" >&2; exit 2 ;;
esac
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}
LOGS=${GPU_CHECK_LOGS:-gpu-check-logs}/$(date -u +%Y-%m-%dT%H-%M-%SZ)
mkdir -p "$LOGS" || exit 2
echo "== logs of every step: $LOGS"
STEPS=()     # "status | name | what it saw", in order, and the lines under a step
FAILED=0

summary() {
    {
        echo
        echo "== summary ($SECONDS s of a $BUDGET_S s budget; python: ${PY:-none}$(
            (( REHEARSE )) && echo "; a rehearsal without a GPU"))"
        local line
        for line in "${STEPS[@]}"; do echo "  $line"; done
        echo "  logs: $LOGS"
    } | tee "$LOGS/summary.txt"
}
trap summary EXIT
trap 'record INTERRUPTED "${CURRENT:-gpu_check.sh}" "stopped by a signal"; exit 130' INT TERM

record() {  # record STATUS NAME [WHAT IT SAW]
    STEPS+=("$1 | $2${3:+ | $3}")
    case $1 in PASS | "NOT RUN") ;; *) FAILED=1 ;; esac
}

# What pytest said at the end of LOG: its closing counts (the last line that has them).
pytest_counts() {
    grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed)|no tests ran' \
        "$1" | grep -E ' in [0-9.]+s' | tail -n 1 | sed -E 's/^[= ]+//; s/[= ]+$//'
}

# Each failure of LOG, under its step in the summary: pytest's FAILED / ERROR line (the test
# and the first line of its error), then the first three `E` lines of each traceback.
pytest_failures() {
    grep -E '^(FAILED|ERROR) ' "$1" | sed 's/^/    /'
    awk '/^___+ .+ ___+$/ { name = $0; gsub(/^_+ | _+$/, "", name); n = 0; next }
         /^=+ short test summary info/ { name = "" }
         /^E / && name != "" && n < 3 { sub(/^E +/, ""); print "      " name ": " $0; n++ }' "$1"
}

# run_step NAME SECONDS COMMAND...: COMMAND under `timeout`, at most SECONDS and never past the
# budget. SIGINT first, so Python (and pytest) stop their ranks and print what they have; in the
# foreground, so a Ctrl-C reaches the step too (ranks that engine.launch started die with it).
# What the step saw: its last RESULT: line, or for pytest its closing counts and failures.
run_step() {
    local name=$1 cap=$2 left limit log rc status saw line
    shift 2
    left=$(( BUDGET_S - SECONDS ))
    if (( left < 15 )); then
        record SKIPPED "$name" "no time left in the budget"
        return
    fi
    limit=$(( cap < left ? cap : left ))
    log=$(printf %s/%02d-%s.log "$LOGS" "${#STEPS[@]}" "$(printf %s "$name" |
        tr -cs 'A-Za-z0-9.' - | cut -c 1-40)")
    CURRENT=$name
    echo
    echo "== $name (at most $limit s; log: $log)"
    timeout --foreground -s INT -k 15 "$limit" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    case $rc in
        0) status=PASS ;;
        124 | 137) status="TIMEOUT after $limit s" ;;
        *) status="FAIL (exit $rc)" ;;
    esac
    saw=$(grep -h '^RESULT: ' "$log" | tail -n 1 | cut -c 9-)
    if [[ " $* " == *" -m pytest "* ]]; then
        saw=$(pytest_counts "$log")
    fi
    if [[ " $* " == *" --collect-only "* ]]; then
        saw="$(grep -cE '^tests/.+::' "$log") tests collected, $(
            grep -cE '^tests/test_gpu\.py::' "$log") of them in tests/test_gpu.py (pytest: $saw)"
    fi
    record "$status" "$name" "$saw"
    if [[ " $* " == *" -m pytest "* ]]; then
        while IFS= read -r line; do STEPS+=("$line"); done < <(pytest_failures "$log")
    fi
    CURRENT=""
}

# A step that needs a GPU, in a rehearsal: named in the summary, not run.
gpu_step() {
    if (( REHEARSE )); then
        record "NOT RUN" "$1" "a rehearsal: needs a CUDA GPU"
    else
        run_step "$@"
    fi
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
PROBE=$(timeout 60 "$PY" -c 'import sys, torch
print(sys.executable, "torch", torch.__version__, "CUDA", torch.version.cuda)
print(torch.cuda.device_count())' 2>&1)
echo "$PROBE"
GPUS=$(tail -n 1 <<<"$PROBE")
case $GPUS in '' | *[!0-9]*) GPUS=0 ;; esac
echo "CUDA GPUs visible to torch: $GPUS"
timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
if (( GPUS < 1 && ! REHEARSE )); then
    record FAIL "environment" "this python sees no CUDA GPU (a CPU build of torch?); \
--rehearse runs what a CPU can"
    exit 2
fi
record PASS "environment" "$PY sees $GPUS GPU(s)"

# -- the tests marked gpu: collected (every one, from every test module), tests/test_gpu.py -----
# -o addopts="" drops the project's nbval options and -p no:nbval the plugin, so pytest runs
# with or without the notebook plugins (the lab image has none); a test module that needs more
# than the lab image skips with the reason.

GPU_TESTS=(-o addopts="" -p no:cacheprovider -p no:nbval -m gpu)
run_step "collect the tests marked gpu" 60 \
    "$PY" -m pytest "${GPU_TESTS[@]}" --collect-only -q tests
gpu_step "tests/test_gpu.py" 150 "$PY" -m pytest "${GPU_TESTS[@]}" -q -rfEs tests/test_gpu.py

# -- smoke checks: what one GPU can show, each in its own fresh process -------------------------

gpu_step "NCCL at world size 1: engine.launch" 45 "$PY" scripts/gpu_smoke.py nccl-1
gpu_step "NCCL at world size 1: engine train --impl both" 90 \
    "$PY" -m engine train --world-size 1 --backend nccl --model medium --steps 5 --zero 0 \
    --impl both
gpu_step "Gloo with CUDA tensors, 3 ranks on one GPU" 45 "$PY" scripts/gpu_smoke.py gloo-cuda-3
gpu_step "forked Gloo ranks touching CUDA" 45 "$PY" scripts/gpu_smoke.py forked-cuda
run_step "a CPU lesson on a GPU host stays on Gloo" 30 "$PY" scripts/gpu_smoke.py cpu-lesson
run_step "torchrun --nproc-per-node 2 on this machine" 60 \
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 scripts/gpu_smoke.py torchrun

# -- every other test marked gpu, with the time that is left ----------------------------------

gpu_step "the other tests marked gpu" 600 \
    "$PY" -m pytest "${GPU_TESTS[@]}" -q -rfEs --ignore tests/test_gpu.py tests

exit $FAILED
