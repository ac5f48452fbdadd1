#!/usr/bin/env bash
# GPU correctness + kernel table in one command (< 5 min on one GPU: tests <= 170 s, each table <= 60 s).
#   benchmarks/gpu_check.sh            # logs to $OUT (if set) or results/gpu_check/
# 1. pytest tests/kernels on CUDA (real Triton, no interpreter; bf16 included)
# 2. chunkserve bench kernel --device cuda --backend triton, fp16 and bf16 (full table, CUDA graphs,
#    rotated KV sets), JSON + PNG next to the logs.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR="${OUT:-results/gpu_check}"
mkdir -p "$LOG_DIR"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
status=0

{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name(0))"
} 2>&1 | tee "$LOG_DIR/env.log"

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "no CUDA device visible; aborting" | tee -a "$LOG_DIR/env.log"; exit 2; }

echo "== kernel tests (CUDA) ==" | tee "$LOG_DIR/pytest.log"
timeout 170 "$PY" -m pytest -q tests/kernels -p no:cacheprovider --durations=10 2>&1 | tee -a "$LOG_DIR/pytest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# `chunkserve bench kernel` if the CLI has it wired, else the same entry point directly
if "$PY" -m chunkserve.cli bench kernel --help >/dev/null 2>&1; then
  BENCH=("$PY" -m chunkserve.cli bench kernel)
else
  BENCH=("$PY" benchmarks/bench_kernel.py)
fi
for dtype in fp16 bf16; do
  echo "== bench kernel (triton, $dtype) ==" | tee "$LOG_DIR/bench_$dtype.log"
  timeout 60 "${BENCH[@]}" --device cuda --backend triton --dtype "$dtype" \
      --out "$LOG_DIR" 2>&1 | tee -a "$LOG_DIR/bench_$dtype.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

echo "gpu_check status: $status (logs in $LOG_DIR)"
exit $status
