"""Python started in the checkout root (``python -m`` / ``-c`` put it on sys.path) still finds PyPI's
``kernels`` package, which transformers >= 5 imports, instead of chunkserve's ``kernels/`` folder."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_in_root(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_bare_kernels_import_in_the_checkout_root_gets_the_installed_package() -> None:
    spec = importlib.util.find_spec("kernels")  # the test runs with -P: this is never the checkout's folder
    if spec is None or "site-packages" not in str(spec.origin):
        pytest.skip("PyPI's kernels package is not installed")
    r = run_in_root("import sys, kernels; print(sys.path[0] == ''); print(kernels.__file__)")
    assert r.returncode == 0, r.stderr
    on_path, origin = r.stdout.split()
    assert on_path == "True"  # the checkout root really was on sys.path
    assert Path(origin).resolve() != (ROOT / "kernels" / "__init__.py").resolve()
    assert "site-packages" in origin


def test_transformers_llama_imports_in_the_checkout_root() -> None:
    r = run_in_root("from transformers import LlamaConfig; import chunkserve.kernels as k; print(k.chunk_attention.__name__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "chunk_attention"
