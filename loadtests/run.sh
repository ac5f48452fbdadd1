#!/usr/bin/env bash
# Multi-tenant load test against a local cluster (started and stopped for you) or a running one.
#
#   loadtests/run.sh                        # 2 workers, random:tiny model, 4 tenants, 60 s
#   loadtests/run.sh --duration 300 --model ""   # the embedded SmolLM2 instead of random weights
#   HOST=http://127.0.0.1:8000 GRPC=127.0.0.1:9000 KEYS=keys.json loadtests/run.sh
#   loadtests/run.sh --soak                 # 10 min near saturation + RSS / KV verdict
#
# Everything after the script name goes to `chunkserve loadtest` (see `chunkserve loadtest --help`);
# results land in loadtest-results/<time>/ (CSV, HTML report, summary.json, PNG plots).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[[ -x $PY ]] || PY=python3
args=()
if [[ -n ${HOST:-} ]]; then
  args+=(--host "$HOST")
  [[ -n ${GRPC:-} ]] && args+=(--grpc-target "$GRPC")
  [[ -n ${KEYS:-} ]] && args+=(--api-keys-file "$KEYS")
else
  args+=(--workers "${WORKERS:-2}" --num-cpus "${NUM_CPUS:-2}")
  model=random:tiny
  engine='{"chunk_size": 16, "num_kv_chunks": 2048}'
  for ((i = 1; i <= $#; i++)); do  # an explicit --model/--engine wins; --model "" = embedded SmolLM2
    if [[ ${!i} == --model ]]; then j=$((i + 1)); model=${!j}; fi
    if [[ ${!i} == --engine ]]; then engine=; fi
  done
  filtered=()
  skip=0
  for a in "$@"; do
    if ((skip)); then skip=0; continue; fi
    if [[ $a == --model ]]; then skip=1; continue; fi
    filtered+=("$a")
  done
  set -- "${filtered[@]+"${filtered[@]}"}"
  [[ -n $model ]] && args+=(--model "$model")
  [[ -n $engine ]] && args+=(--engine "$engine")
fi
exec timeout --signal=INT "${TIMEOUT:-3600}" "$PY" -m chunkserve.cli loadtest "${args[@]}" "$@"
