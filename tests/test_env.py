"""Environment variables are read in one module, `chunkserve/env.py`, at call time."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from chunkserve import env

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("kernels", "workers", "cluster", "router", "chunkserve")
READ = re.compile(r"os\.environ\.get\(|os\.environ\[|os\.getenv\(")


def test_no_library_module_reads_the_environment_but_env_py() -> None:
    readers = []
    for top in LIBRARY:
        for path in (ROOT / top).rglob("*.py"):
            if path == ROOT / "chunkserve" / "env.py" or "tools" in path.relative_to(ROOT).parts:
                continue  # tools may pass the environment on to the processes they start
            if READ.search(path.read_text()):
                readers.append(str(path.relative_to(ROOT)))
    assert readers == [], f"read these through chunkserve.env: {readers}"


def test_env_is_read_at_call_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(env.REDIS_URL, raising=False)
    assert env.redis_url() is None
    monkeypatch.setenv(env.REDIS_URL, "")
    assert env.redis_url() is None
    monkeypatch.setenv(env.REDIS_URL, "redis://h:1/0")
    assert env.redis_url() == "redis://h:1/0"
    monkeypatch.setenv(env.CACHE, str(tmp_path))
    assert env.cache_root() == tmp_path
    monkeypatch.delenv(env.CACHE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert env.cache_root() == tmp_path / "xdg" / "chunkserve"
    monkeypatch.setenv(env.CPU_KERNEL, "0")
    monkeypatch.setenv(env.QKERNEL, "1")
    assert not env.cpu_kernel_enabled() and env.qkernel_enabled()
    monkeypatch.setenv("CXX", "definitely-not-a-compiler-xyz")
    assert env.cxx_compiler() != "definitely-not-a-compiler-xyz"
