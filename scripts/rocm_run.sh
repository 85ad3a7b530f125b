#!/usr/bin/env bash
# The evidence run on an AMD GPU (MI300X gfx942, MI350X/MI355X gfx950), the one command:
#   bash scripts/rocm_run.sh                    # every step; the report is rocm-out/rocm_report.md
#   bash scripts/rocm_run.sh --dry-run          # print the steps and write the report skeleton, run nothing
#   bash scripts/rocm_run.sh verify bench       # some steps only (names below)
# Steps: env (ROCm torch + GPU + AMD's AITER present), gpu-tests (pytest -m gpu), verify (aiter-patches
# verify --model $MODEL on this AITER: the checks and the self-check at every token bucket), code-objects (the .co metadata check on this AITER's GEMM kernels), precompile
# (aiter-patches compile --cache-dir), serving-loop (0 JIT compiles with that cache), bench (patched vs
# AITER's own kernels). A failing step is recorded and the next one runs; the exit status is 1 if any failed.
# Settings (environment): OUT=rocm-out  MODEL=deepseek-v3 (deepseek-v3 | qwen3-235b | minimax-m3 | kimi-k3)
#   ARCH (default: this GPU's, e.g. gfx942)  PYTHON=python3  STEP_TIMEOUT=5400 (seconds per step)  QUICK=1 (short bench)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
MODEL=${MODEL:-deepseek-v3}
STEP_TIMEOUT=${STEP_TIMEOUT:-5400}
OUT=${OUT:-rocm-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
ALL=(env gpu-tests verify code-objects precompile serving-loop bench)

DRY=0
steps=()
for a in "$@"; do
  case $a in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) if [[ " ${ALL[*]} " == *" $a "* ]]; then steps+=("$a"); else echo "unknown step: $a (${ALL[*]})"; exit 2; fi ;;
  esac
done
[ ${#steps[@]} -eq 0 ] && steps=("${ALL[@]}")

if [ -z "${ARCH:-}" ]; then
  ARCH=$("$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); print(p.gcnArchName.split(":")[0])' \
         2>/dev/null | tail -n 1)
  [[ $ARCH == gfx* ]] || ARCH=unknown
fi
CACHE=$OUT/triton-cache
STEPS=$OUT/steps.tsv
: > "$STEPS"

record() {  # name status seconds rc command log
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >> "$STEPS"
}

status_of() {  # the recorded status of a step in this run, or nothing
  awk -F'\t' -v n="$1" '$1 == n { s = $2 } END { print s }' "$STEPS"
}

run_step() {  # name command...
  local name=$1; shift
  local cmd="$*"
  if [ $DRY -eq 1 ]; then
    echo "[dry-run] $name: $cmd"
    record "$name" DRY-RUN 0 - "$cmd" "$name.log"
    return
  fi
  echo "== $name: $cmd"
  local start=$SECONDS rc status
  timeout -k 30 "$STEP_TIMEOUT" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  case $rc in 0) status=PASS ;; 124|137) status=TIMEOUT ;; *) status=FAIL ;; esac
  record "$name" "$status" $((SECONDS - start)) "$rc" "$cmd" "$name.log"
  tail -n 5 "$OUT/$name.log" | sed 's/^/   /'
  echo "   -> $status (exit $rc, $((SECONDS - start)) s)"
}

skip_step() {  # name reason
  echo "== $1: SKIP ($2)"
  record "$1" SKIP 0 - - "$2"
}

fail_step() {  # name reason: a step that cannot start counts as failed
  echo "== $1: FAIL ($2)"
  echo "$2" > "$OUT/$1.log"
  record "$1" FAIL 0 - - "$1.log"
}

has_compile() {
  "$PY" -m aiter_patches compile --help > /dev/null 2>&1
}

for step in "${steps[@]}"; do
  case $step in
    env) run_step env "$PY" scripts/rocm_report.py --preflight ;;
    gpu-tests) run_step gpu-tests "$PY" -m pytest -m gpu -q -p no:cacheprovider tests ;;
    verify) run_step verify "$PY" -m aiter_patches verify --model "$MODEL" ;;
    code-objects) run_step code-objects "$PY" scripts/check_code_objects.py ;;
    precompile)
      if [ $DRY -eq 0 ] && ! has_compile; then
        fail_step precompile "this aiter_patches has no 'compile' command (issue 13 items 1-2): nothing to precompile"
      else
        [ $DRY -eq 1 ] || rm -rf "$CACHE"
        run_step precompile "$PY" -m aiter_patches compile --arch "$ARCH" --model "$MODEL" --cache-dir "$CACHE"
      fi ;;
    serving-loop)
      pre=$(status_of precompile)
      if [ "$pre" = FAIL ] || [ "$pre" = TIMEOUT ]; then
        skip_step serving-loop "the precompile step did not pass ($pre): no cache to check"
      elif [ $DRY -eq 0 ] && [ ! -d "$CACHE" ] && [ "$pre" = PASS ]; then
        fail_step serving-loop "the precompile step passed but left no cache at $CACHE"
      elif [ $DRY -eq 0 ] && [ ! -d "$CACHE" ]; then
        skip_step serving-loop "no precompiled cache at $CACHE (run the precompile step)"
      else
        run_step serving-loop env TRITON_CACHE_DIR="$CACHE" "$PY" scripts/serving_loop_compiles.py \
          --model "$MODEL" --json "$OUT/serving_loop.json"
      fi ;;
    bench) run_step bench "$PY" bench/bench_vs_aiter_rocm.py --aiter --out "$OUT/bench_vs_aiter.md" \
             ${QUICK:+--quick} ;;
  esac
done

rm -f "$OUT/rocm_report.md"
"$PY" scripts/rocm_report.py --steps "$STEPS" --out "$OUT/rocm_report.md" --model "$MODEL" --arch "$ARCH" \
  > "$OUT/report.log" 2>&1
if [ ! -s "$OUT/rocm_report.md" ]; then  # the writer itself failed: never leave no report
  { echo "# aiter_patches on an AMD GPU (raw: the report writer failed, see report.log)"; echo
    echo '~~~'; cat "$STEPS" "$OUT/report.log"; echo '~~~'; } > "$OUT/rocm_report.md"
fi
echo "report: $OUT/rocm_report.md"
if awk -F'\t' '$2 == "FAIL" || $2 == "TIMEOUT" { bad = 1 } END { exit !bad }' "$STEPS"; then
  exit 1
fi
exit 0
