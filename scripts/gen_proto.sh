#!/usr/bin/env bash
# Regenerates chunkserve/v1/generate_pb2.py and generate_pb2_grpc.py from chunkserve/v1/generate.proto
# with grpcio-tools (pip install grpcio-tools). Run from anywhere; the output is committed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
cd "$ROOT"
"$PY" -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. chunkserve/v1/generate.proto
echo "generated: chunkserve/v1/generate_pb2.py chunkserve/v1/generate_pb2_grpc.py"
