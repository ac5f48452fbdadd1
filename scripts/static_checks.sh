#!/usr/bin/env bash
# Static checks over the whole tree: the import contract (import-linter, contracts in .importlinter) and the
# type check (mypy, settings in mypy.ini). Both need the package as it is imported, but the source folders
# (kernels/ workers/ cluster/ router/ loadtests/) install under chunkserve.* through setuptools' package-dir
# mapping, which static tools cannot follow. So this script lays out build/static/chunkserve/ as the import
# path sees it: symlinks to chunkserve/'s own entries and to each mapped folder (the same mapping as
# pyproject.toml's [tool.setuptools] package-dir), and points the tools there. Nothing is copied: edits are
# seen at once. Usage: scripts/static_checks.sh [imports|types|all|tree] (default all; tree: only the layout).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${VPY:-$PWD/.venv/bin/python}
what=${1:-all}
"$PY" - <<'PY'
import os, pathlib, shutil, tomllib
root = pathlib.Path.cwd()
mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
tree = root / "build" / "static"
shutil.rmtree(tree, ignore_errors=True)
pkg = tree / "chunkserve"
pkg.mkdir(parents=True)
mapped = {name.split(".", 1)[1]: src for name, src in mapping.items() if name != "chunkserve"}
for entry in (root / mapping.get("chunkserve", "chunkserve")).iterdir():
    if entry.name not in mapped and entry.name != "__pycache__":
        os.symlink(entry, pkg / entry.name)
for sub, src in mapped.items():
    os.symlink(root / src, pkg / sub, target_is_directory=True)
PY
[[ $what == tree ]] && exit 0
export PYTHONPATH="$PWD/build/static${PYTHONPATH:+:$PYTHONPATH}" MYPYPATH="$PWD/build/static"
rc=0
if [[ $what == all || $what == imports ]]; then
  (cd build/static && "$(dirname "$PY")/lint-imports" --no-cache "$OLDPWD/.importlinter") || rc=1
fi
if [[ $what == all || $what == types ]]; then
  "$PY" -m mypy --config-file mypy.ini -p chunkserve || rc=1
fi
exit $rc
