#!/usr/bin/env bash
# The GPU verification run (device machine): bitwise tests, graph capture, memcheck, verify.
# Usage: bash scripts/gpu_run.sh [tests|memcheck|bench|all]; logs go to $OUT (or ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
what=${1:-all}
rc=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 40 || rc=1
  python3 -m aiter_patches verify 2>&1 | tee "$OUT/verify.log" || rc=1
fi
if [[ $what == memcheck || $what == all ]]; then
  compute-sanitizer --tool memcheck --error-exitcode 3 python3 scripts/memcheck_kernels.py 2>&1 \
    | tee "$OUT/memcheck.log" | tail -n 20 || rc=1
fi
if [[ $what == bench || $what == all ]]; then
  python3 bench/bench_moe_sort_quant.py --out "$OUT/moe_sort_quant.md" | tail -n 5 || rc=1
  python3 bench/bench_blockscale_gemm.py --out "$OUT/blockscale_gemm.md" | tail -n 5 || rc=1
  python3 bench/bench_addend_fold.py --out "$OUT/addend_fold.md" | tail -n 5 || rc=1
fi
exit $rc
