"""The engine, the KV cache and the kernel benchmark import without redis-py (a GPU box may lack it);
only the cluster index needs it."""

from __future__ import annotations

import subprocess
import sys

BLOCK_REDIS = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "redis" or name.startswith("redis."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Block())
"""


def test_engine_cache_and_kernel_bench_import_without_redis() -> None:
    code = BLOCK_REDIS + ("import chunkserve.workers.engine, chunkserve.workers.kvcache, chunkserve.kernels, "
                          "chunkserve.tools.bench_kernel\nprint('redis' in sys.modules)")
    r = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_the_cluster_publisher_still_needs_redis() -> None:
    r = subprocess.run([sys.executable, "-P", "-c", BLOCK_REDIS + "import chunkserve.cluster.events"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "redis" in r.stderr
