#!/usr/bin/env bash
# The GPU verification run on a CUDA or ROCm machine, in parts that each fit a 10-minute slot:
#   bash scripts/gpu_run.sh kernels    # tests/kernels and tests/stub at full size (about 6 min on an H200)
#   bash scripts/gpu_run.sh patches    # tests/patches: graph capture, full-size patch tests; aiter-patches verify
#   bash scripts/gpu_run.sh memcheck   # compute-sanitizer memcheck over every kernel on adversarial inputs
#   bash scripts/gpu_run.sh bench      # the two benchmarks (tables under $OUT)
#   JOBS=8 bash scripts/gpu_run.sh kernels patches   # test parts spread over 8 pytest-xdist workers (compile-bound)
# Logs and tables go to $OUT (default ./gpu-out); the exit status is non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
rc=0
xdist=()
[ -n "${JOBS:-}" ] && xdist=(-n "$JOBS")
step() { local name=$1; shift; echo "== $name"; "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 25 || rc=1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>/dev/null | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"
for what in "${@:-kernels}"; do
  case $what in
    kernels) step kernels python3 -m pytest -m gpu -q -p no:cacheprovider "${xdist[@]}" tests/kernels tests/stub ;;
    patches) step patches python3 -m pytest -m gpu -q -p no:cacheprovider "${xdist[@]}" tests/patches
             step verify python3 -m aiter_patches verify ;;
    memcheck) step memcheck compute-sanitizer --tool memcheck --error-exitcode 3 python3 scripts/memcheck_kernels.py ;;
    bench) python3 bench/bench_moe_sort_quant.py --out "$OUT/moe_sort_quant.md" | tail -n 3 || rc=1
           python3 bench/bench_addend_fold.py --out "$OUT/addend_fold.md" | tail -n 3 || rc=1 ;;
    *) echo "unknown part: $what (kernels | patches | memcheck | bench)"; exit 2 ;;
  esac
done
exit $rc
