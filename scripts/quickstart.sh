#!/usr/bin/env bash
# Installs everything (idempotent) and runs the main job, `chunkserve up` (a local cluster serving the
# embedded default model over HTTP :8000 and gRPC :9000); other subcommands: bash scripts/quickstart.sh demo
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh loadtest
exec .venv/bin/chunkserve "${@:-up}"
