"""The forest summary: runs merged, scopes kept apart, usage recorded, size bounded, no token ids."""

from __future__ import annotations

import json

import torch

from chunkserve.workers.kvcache import PrefixKVCache
from chunkserve.workers.tree_summary import ForestUsage, summarize_forest

C = 4


def _cache(n: int = 256) -> PrefixKVCache:
    return PrefixKVCache(num_layers=1, num_kv_heads=1, head_dim=2, chunk_size=C, num_chunks=n)


def _add(cache: PrefixKVCache, tokens: list[int], salt: bytes) -> int:
    kv = torch.zeros(1, len(tokens), 1, 2)  # [L, n, Hkv, D]
    return cache.add_sequence(tokens, kv, kv, salt=salt)


def test_shared_prefix_is_one_run_with_both_tenants_and_private_scope_apart() -> None:
    cache = _cache()
    usage = ForestUsage(clock=lambda: 1000.0)
    shared = list(range(100, 112))  # 3 chunks
    a = shared + [1, 2, 3, 4]
    b = shared + [5, 6, 7, 8]
    sa = _add(cache, a, b"grp")
    usage.record(cache, a, b"grp", 0, "acme")
    _add(cache, b, b"grp")  # still running: ref 1 on the shared run
    usage.record(cache, b, b"grp", len(shared), "globex")
    priv = [900 + i for i in range(8)]
    _add(cache, priv, b"initech")
    usage.record(cache, priv, b"initech", 0, "initech")
    cache.remove_sequence(sa)
    summary = summarize_forest(cache, usage)
    scopes = {s["scope"]: s for s in summary["scopes"]}
    assert set(scopes) == {"grp", "initech"}
    (run,) = scopes["grp"]["runs"]
    assert (run["tokens"], run["chunks"], run["ref"], run["hits"]) == (12, 3, 1, 1)
    assert run["tenants"] == ["acme", "globex"]
    assert run["last_use"] == 1000.0 and run["pinned"] is False
    assert sorted(k["tenants"][0] for k in run["children"]) == ["acme", "globex"]
    (p,) = scopes["initech"]["runs"]
    assert p["tenants"] == ["initech"] and p["tokens"] == 8 and p["hits"] == 0
    text = json.dumps(summary)
    assert "100" not in text.replace("1000.0", "")  # no token ids anywhere


def test_pinned_prefix_is_reported_as_pinned() -> None:
    cache = _cache()
    toks = list(range(50, 58))
    s = _add(cache, toks, b"t")
    cache.pin_prefix(toks, b"t")
    cache.remove_sequence(s)
    (run,) = summarize_forest(cache)["scopes"][0]["runs"]
    assert run["pinned"] is True and run["ref"] == 0


def test_summary_is_bounded_and_counts_the_rest() -> None:
    cache = _cache(n=2048)
    for i in range(100):  # 100 distinct 2-chunk prompts in one scope
        cache.remove_sequence(_add(cache, [10_000 + 8 * i + j for j in range(8)], b"t"))
    summary = summarize_forest(cache, top_n=10, max_runs=50)
    (scope,) = summary["scopes"]
    assert len(scope["runs"]) == 10
    assert scope["more"] == {"subtrees": 90, "tokens": 720}
    assert summary["runs_shown"] <= 50
    assert scope["tokens"] == 800


def test_usage_forgets_evicted_chunks() -> None:
    cache = _cache(n=8)
    usage = ForestUsage()
    toks = list(range(16))
    cache.remove_sequence(_add(cache, toks, b"t"))
    assert usage.record(cache, toks, b"t", 16, "t") == 4
    cache.clear()
    summarize_forest(cache, usage)
    assert len(usage) == 0
