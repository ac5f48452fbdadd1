#!/usr/bin/env bash
# Installs what the tests need (idempotent) and runs the whole suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
# -P / PYTHONSAFEPATH: the checkout root never goes on sys.path, so its kernels/ folder cannot shadow
# PyPI's `kernels` package (transformers >= 5 imports it); subprocesses the tests start inherit it
export PYTHONSAFEPATH=1
exec .venv/bin/python -P -m pytest "$@"
