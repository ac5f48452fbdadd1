#!/usr/bin/env bash
# GPU check in one command, offline, on one GPU, in under 5 minutes:
#   benchmarks/gpu_check.sh                          # logs + JSON in $OUT if set, else results/gpu_check/
#                                                    # (and all of them in 00_all.tgz there)
#   PYTHON=/opt/py/bin/python benchmarks/gpu_check.sh
# Needs a Python with a CUDA build of torch and with triton (and numpy, tqdm, which the KV
# cache imports; pytest + hypothesis for step 2; not redis-py). It installs and downloads nothing: when chunkserve is
# not importable (no `pip install --no-deps -e .`), the checkout is mapped into a temporary package
# dir (the setuptools package-dir layout: chunkserve.kernels -> kernels/, ...) put on PYTHONPATH.
# Steps, each under its own time limit and all inside a 290 s budget (a step left < 20 s is skipped):
#   1. preflight: the Python used, its torch build, the GPU; what is missing and which step needs it
#   2. pytest on CUDA (real Triton, no interpreter; bf16 included): test_triton/decode/prefill/api
#   3. agreement: every decode backend (and TPP/paged with kv_split 1 and 4) vs float64 at a
#      Llama-3-8B layer shape over a NaN-poisoned pool, bf16 and fp16
#   4. chunkserve bench kernel --quick: fp16 MHA (the paper's setting) and bf16 GQA Hkv=8 (Llama-3-8B)
#   5. e2e: random-weight Llama-3-8B in bf16, greedy decode with triton / paged-triton / torch; on triton
#      the warm-up, kernels compiled after it (0) and syncs per step under torch.cuda sync debug mode (<= 1)
#   6. report: a table with a PASS/FAIL line per target (TPP >= 50% of HBM bandwidth and >= 4.8x dense
#      attention at n_p = n_s = 4096; TPP vs paged outputs; tests; agreement; e2e)
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
LOG_DIR="${OUT:-results/gpu_check}"
mkdir -p "$LOG_DIR"
LOG_DIR="$(cd "$LOG_DIR" && pwd)"
rm -f "$LOG_DIR"/kernel_cuda_triton_*.json "$LOG_DIR"/{preflight,agree,e2e}.json "$LOG_DIR"/pytest.xml
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
# never put the checkout root on sys.path (python -m / -c do): its kernels/ folder would shadow PyPI's
# `kernels` package, which transformers >= 5 imports
export PYTHONSAFEPATH=1
BUDGET=290
START=$SECONDS

# a Python whose torch sees a GPU: $PYTHON, python3, python, then the checkout's venv
PY=""
for cand in "${PYTHON:-}" python3 python .venv/bin/python; do
  [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 || continue
  if "$cand" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    PY="$cand"; break
  fi
done

SHADOW=""
cleanup() { [ -n "$SHADOW" ] && rm -rf "$SHADOW"; }
trap cleanup EXIT
if [ -n "$PY" ] && ! (cd / && "$PY" -c "import chunkserve.kernels.api") >/dev/null 2>&1; then
  SHADOW="$(mktemp -d)"
  mkdir "$SHADOW/chunkserve"
  for f in "$ROOT"/chunkserve/*; do ln -s "$f" "$SHADOW/chunkserve/"; done
  for p in kernels workers cluster router loadtests; do ln -s "$ROOT/$p" "$SHADOW/chunkserve/$p"; done
  export PYTHONPATH="$SHADOW${PYTHONPATH:+:$PYTHONPATH}"
  echo "chunkserve not installed: using the checkout through $SHADOW"
fi

echo "== 1. preflight ==" | tee "$LOG_DIR/preflight.log"
{ echo "date: $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true; } \
  | tee -a "$LOG_DIR/preflight.log"
if [ -z "$PY" ]; then
  # say why for every candidate: no torch, a CPU-only torch, or a CUDA torch without a visible device
  for cand in "${PYTHON:-}" python3 python .venv/bin/python; do
    [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 || continue
    echo "-- $cand" | tee -a "$LOG_DIR/preflight.log"
    "$cand" benchmarks/gpu_check.py preflight "$LOG_DIR" 2>&1 | tee -a "$LOG_DIR/preflight.log"
  done
  echo "FAIL: no Python here has a CUDA build of torch that sees a GPU (see above); set PYTHON=..." \
    | tee -a "$LOG_DIR/preflight.log"
  exit 2
fi
timeout 60 "$PY" benchmarks/gpu_check.py preflight "$LOG_DIR" 2>&1 | tee -a "$LOG_DIR/preflight.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "FAIL: preflight (see above)"; exit 2; }

left() { echo $(( BUDGET - (SECONDS - START) )); }
# run STEP_NAME LIMIT LOG CMD...: under min(LIMIT, budget left); skipped when under 20 s are left
run() {
  local name="$1" limit="$2" log="$3"; shift 3
  local t; t=$(left); [ "$t" -lt "$limit" ] && limit=$t
  echo "== $name (limit ${limit}s) ==" | tee "$LOG_DIR/$log"
  if [ "$limit" -lt 20 ]; then echo "skipped: the time budget is spent" | tee -a "$LOG_DIR/$log"; return; fi
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG_DIR/$log"
  local rc="${PIPESTATUS[0]}"
  [ "$rc" -eq 124 ] && echo "TIMEOUT after ${limit}s" | tee -a "$LOG_DIR/$log"
  return 0
}

run "2. kernel tests on CUDA" 110 pytest.log "$PY" -m pytest -q -p no:cacheprovider --durations=10 \
  --junitxml="$LOG_DIR/pytest.xml" tests/kernels/test_triton.py tests/kernels/test_decode.py \
  tests/kernels/test_prefill.py tests/kernels/test_api.py
run "3. backend agreement" 35 agree.log "$PY" benchmarks/gpu_check.py agree "$LOG_DIR"
run "4a. bench kernel fp16 MHA" 50 bench_fp16.log "$PY" -m chunkserve.cli bench kernel --device cuda \
  --backend triton --dtype fp16 --quick --out "$LOG_DIR"
run "4b. bench kernel bf16 GQA (Llama-3-8B)" 45 bench_bf16.log "$PY" -m chunkserve.cli bench kernel \
  --device cuda --backend triton --dtype bf16 --kv-heads 8 --quick --out "$LOG_DIR"
run "5. e2e decode (random Llama-3-8B, bf16)" 70 e2e.log "$PY" benchmarks/gpu_check.py e2e "$LOG_DIR"

"$PY" benchmarks/gpu_check.py report "$LOG_DIR" 2>&1 | tee "$LOG_DIR/report.log"
status="${PIPESTATUS[0]}"
# every log and JSON in one file too, named to sort first: a caller that brings back only a few files of
# $OUT (the device tool returns 8) still gets all of them
rm -f "$LOG_DIR/00_all.tgz"
bundle="$(mktemp)"
tar czf "$bundle" -C "$LOG_DIR" . && chmod 644 "$bundle" && mv "$bundle" "$LOG_DIR/00_all.tgz" || rm -f "$bundle"
echo "gpu_check: $([ "$status" -eq 0 ] && echo PASS || echo FAIL) in $((SECONDS - START)) s (logs in $LOG_DIR)"
exit "$status"
