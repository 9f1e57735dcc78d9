#!/usr/bin/env bash
# Everything GPU-specific in one run of at most --budget-s seconds (default 340) on one H100/H200, in order of value:
#   1. facts: the device, jax, CUDA, cuDNN, and what XLA makes of ragged_dot at DeepSeek-V3's shape;
#   2. bench/kernels.py: the ceilings (copy bandwidth, bf16 matmul), then each kernel on real layer shapes against
#      them, the XLA reference, cuDNN / ragged_dot and jax's own Mosaic GPU kernels;
#   3. `python -m kernels_pallas.selfcheck` on the device: every candidate on every flagship's shapes;
#   4. the kernel tests' compiled-kernel classes (TestMosaicGpu, TestCudnn: they run only where a GPU does).
# Each step runs under its own `timeout` (and the benches under their own --budget-s), writes its log, its rows
# (JSON lines, flushed as measured) and a line of status.txt as it ends, so a kill keeps what was done; a step
# that fails never stops the ones after it. Results go to $OUT (the device tool's output folder) or bench/out.
# Needs only jax (with its CUDA plugin), numpy and pytest: it runs from the checkout, no install.
#
# Usage: bench/gpu.sh [--budget-s S] [--cpu-smoke]      (PYTHON=... chooses the interpreter; default python3)
#   --cpu-smoke: the same steps on the CPU at tiny shapes, Pallas kernels in the interpreter (the test suite runs
#   it, so the script cannot rot between device runs).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-bench/out}
BUDGET=
SMOKE=0
while (($#)); do
    case $1 in
        --cpu-smoke) SMOKE=1 ;;
        --budget-s) BUDGET=$2; shift ;;
        *) echo "usage: bench/gpu.sh [--budget-s S] [--cpu-smoke]" >&2; exit 2 ;;
    esac
    shift
done
# On the CPU the limits only stop a hung step: a loaded machine must not turn a slow step into a failure.
BUDGET=${BUDGET:-$((SMOKE ? 1500 : 340))}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
STATUS="$OUT/status.txt"
echo "start $(date -u +%FT%TZ) budget ${BUDGET}s cpu_smoke=$SMOKE" >> "$STATUS"
START=$SECONDS
status=0

# step NAME LIMIT COMMAND...: COMMAND under `timeout`, at most LIMIT seconds and never past the budget; its output
# in $OUT/NAME.txt; one line "NAME rc=.. seconds=.." (or "NAME skipped: budget") in status.txt.
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - (SECONDS - START)))
    if ((left < 5)); then
        echo "$name skipped: budget" | tee -a "$STATUS"
        status=1
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (at most ${limit}s, $(date -u +%H:%M:%S))"
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    local rc=${PIPESTATUS[0]}
    local note=""
    ((rc == 124 || rc == 137)) && note=" timed out"
    echo "$name rc=$rc seconds=$((SECONDS - t0))$note" | tee -a "$STATUS"
    ((rc != 0)) && status=1
}

# A step's own --budget-s: its limit less a margin to write its results and exit.
inner() { echo $(($1 > 30 ? $1 - 15 : $1 * 2 / 3)); }

if ((SMOKE)); then
    export JAX_PLATFORMS=cpu
    SMOKE_FLAG=(--cpu-smoke)
    BENCH=(--iters 2)
    # One family's shapes of three ops in the interpreter (seconds per case): the step's path, not a coverage.
    SELFCHECK=(--interpret --scale tiny --family qwen3-next-80b-a3b --op paged_attention --op moe
               --op gated_delta_rule)
    KERNEL_TESTS=(tests/test_kernels_moe.py)
    LIMITS=(300 400 400 300)
else
    SMOKE_FLAG=()
    BENCH=(--markdown)
    # Every family's shapes: Gemma 2 (head 256, soft-cap, window, paged head 256), gpt-oss (head 64, sinks,
    # window), DeepSeek-V3's MLA (head 576: declined by the Mosaic kernels), linear attention, Mamba2.
    SELFCHECK=()
    for family in llama-3-8b qwen3-30b-a3b gemma-2-9b gpt-oss-20b deepseek-v3 deepseek-v3.2 qwen3-next-80b-a3b \
        kimi-linear-48b-a3b nemotron-3-nano-30b-a3b; do
        SELFCHECK+=(--family "$family")
    done
    KERNEL_TESTS=(tests/test_kernels_attention.py tests/test_kernels_paged_attention.py tests/test_kernels_moe.py
                  tests/test_kernels_rms_norm.py tests/test_kernels_gated_delta_rule.py
                  tests/test_kernels_mamba2_ssd.py)
    LIMITS=(45 170 60 65)  # the budget's 340 seconds: a 6-minute call with time to start and copy back
fi
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv \
        > "$OUT/nvidia-smi.txt" 2>&1
fi
step facts "${LIMITS[0]}" "$PY" bench/device_facts.py --json "$OUT/facts.json" "${SMOKE_FLAG[@]}"
step kernels "${LIMITS[1]}" "$PY" bench/kernels.py "${SMOKE_FLAG[@]}" "${BENCH[@]}" --jsonl "$OUT/kernels.jsonl" \
    --json "$OUT/kernels.json" --budget-s "$(inner "${LIMITS[1]}")"
step selfcheck "${LIMITS[2]}" "$PY" -m kernels_pallas.selfcheck "${SELFCHECK[@]}" --jsonl "$OUT/selfcheck.jsonl" \
    --budget-s "$(inner "${LIMITS[2]}")"
PYTEST_TIMEOUT=()
((BUDGET - (SECONDS - START) >= 5)) && timeout 20 "$PY" -c "import pytest_timeout" 2>/dev/null &&
    PYTEST_TIMEOUT=(--timeout 120)
# -k: the compiled kernels only (their interpreter twins are CPU tests the suite runs anyway).
step kernel_tests "${LIMITS[3]}" "$PY" -m pytest -q -p no:cacheprovider "${PYTEST_TIMEOUT[@]}" \
    -k "(TestMosaicGpu or TestCudnn) and not Interpret" "${KERNEL_TESTS[@]}"

echo "end $(date -u +%FT%TZ) status $status" >> "$STATUS"
echo "== done: status $status; results in $OUT (copy the tables into bench/RESULTS.md with the date and device)"
exit $status
