"""CI smoke test of `chunkserve loadtest`: 30 s of multi-tenant load on a 2-worker local cluster.

Starts Ray, Redis and the Serve app with the cheap ``random:tiny`` model (about 30-60 s on a loaded
2-core machine), runs locust with HTTP and gRPC users of 4 tenants for 30 s, and checks that no request
failed, that the prefix cache served most prompt tokens, and that every report file was written.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TIMEOUT_S = 420  # cluster start (~40 s, more when the machine is busy) + 30 s load + drain + shutdown


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_loadtest_smoke_has_no_failures_and_high_cache_hit_rate(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "chunkserve.cli", "loadtest", "--workers", "2", "--model", "random:tiny",
           "--num-cpus", "2", "--engine", json.dumps({"chunk_size": 16, "num_kv_chunks": 1024}),
           "--tenants", "4", "--prompt-tokens", "512", "--users", "4", "--duration", "30",
           "--max-tokens", "16", "--think-time", "1.0", "--startup-timeout", "240", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    tail = (proc.stdout + proc.stderr)[-4000:]
    summary_path = out / "summary.json"
    assert summary_path.is_file(), tail
    s = json.loads(summary_path.read_text())
    assert s["requests"] >= 20, tail  # 4 users, ~1 s think time, 30 s
    assert s["failed"] == 0, s["errors"]
    assert set(s["by_proto"]) == {"http", "grpc"}
    assert len(s["by_tenant"]) == 4
    hit = s["server"]["prefix_cache_hit_rate"]  # prefix_cache_hits_total / prefix_cache_queries_total
    assert hit is not None and hit > 0.5, s["server"]
    assert s["cached_token_ratio"] > 0.5  # the same, seen by the clients (usage.cached_tokens)
    assert s["ttft_ms"]["p50"] is not None and s["tpot_ms"]["p50"] is not None
    for name in ("locust_stats.csv", "locust_stats_history.csv", "locust_report.html", "requests.jsonl",
                 "metrics.json", "throughput.png", "latency.png", "kv_cache.png", "tenants.yaml"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    tenants = (out / "tenants.yaml").read_text()
    keys = json.loads((out / "api_keys.json").read_text())
    assert all(k not in tenants for k in keys.values())  # only hashes in the server's file
    assert proc.returncode == 0, tail
