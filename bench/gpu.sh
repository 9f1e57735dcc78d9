#!/usr/bin/env bash
# Everything GPU-specific in one run, a few minutes on one H100/H200:
#   1. the kernel tests' compiled-kernel classes (TestMosaicGpu, TestCudnn: they exist only where a GPU runs them);
#   2. `python -m kernels_pallas.selfcheck` on the real device: every candidate of every op, serving-sized shapes;
#   3. bench/kernels.py: each kernel against the ceilings it measures (copy bandwidth, bf16 matmul rate) and
#      against the XLA reference and cuDNN / ragged_dot.
# Logs and JSON go to $OUT (the device tool's output folder) or bench/out. Needs only jax (with its CUDA plugin)
# and numpy: it runs from the checkout, no install. Later sections (engine benchmarks) append below.
# Usage: bench/gpu.sh            (PYTHON=... to choose the interpreter; default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
step() { echo; echo "== $* ($(date -u +%H:%M:%S))"; }

step "device"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv 2>&1 | tee "$OUT/device.txt"
$PY -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/device.txt" || exit 1

step "kernels: tests of the compiled kernels"
$PY -m pytest -q -p no:cacheprovider -k "not Interpret" tests/test_kernels_attention.py \
    tests/test_kernels_paged_attention.py tests/test_kernels_moe.py tests/test_kernels_rms_norm.py \
    2>&1 | tee "$OUT/kernel_tests.txt" || status=1

step "kernels: selfcheck on the device"
$PY -m kernels_pallas.selfcheck --save "$OUT/selfcheck.json" 2>&1 | tee "$OUT/selfcheck.txt" || status=1

step "kernels: benchmark"
$PY bench/kernels.py --markdown --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.txt" || status=1

# --- further GPU benchmarks (engine, ...) append their sections here ---

step "done: status $status; results in $OUT (copy the tables into bench/RESULTS.md with the date)"
exit $status
