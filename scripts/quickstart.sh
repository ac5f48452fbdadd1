#!/usr/bin/env bash
# Installs everything (idempotent) and runs the main job on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh loadtest
exec .venv/bin/chunkserve "${@:-demo}"
