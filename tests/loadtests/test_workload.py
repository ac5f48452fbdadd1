"""Fast tests of the load-test workload generator and of the loadtest reports (no cluster)."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

from chunkserve.tools.loadtest_metrics import Sample, parse_metrics
from chunkserve.tools.loadtest_report import percentile, soak_verdict, summarize

ROOT = Path(__file__).resolve().parents[2]


def _workload() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chunkserve_lt_workload", ROOT / "loadtests" / "workload.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def wl() -> ModuleType:
    return _workload()


@pytest.fixture(scope="module")
def tok(wl: ModuleType) -> object:
    from chunkserve.workers.weights import embedded_checkpoint_dir

    path = embedded_checkpoint_dir()
    if not (Path(path) / "tokenizer.json").is_file():
        pytest.skip("embedded tokenizer not available")
    return wl.load_tokenizer(path)


def test_tenant_prompts_have_the_requested_token_length_and_are_deterministic(wl: ModuleType, tok: object) -> None:
    cfg = wl.WorkloadConfig(num_tenants=3, prompt_tokens=(512, 1024), sharing_ratio=1.0, questions_per_tenant=5)
    a = wl.build_workload(cfg, tok)
    b = wl.build_workload(cfg, tok)
    assert [t.shared_prompt for t in a] == [t.shared_prompt for t in b]
    lens = [len(tok.encode(t.shared_prompt)) for t in a]
    assert all(abs(n - want) <= 2 for n, want in zip(lens, (512, 1024, 512), strict=True)), lens
    assert len({t.shared_prompt for t in a}) == 3  # every tenant has its own prompt
    assert '"type": "function"' in a[0].shared_prompt and "<tool_call>" in a[0].shared_prompt
    assert len(a[0].questions) == 5


def test_sharing_ratio_splits_shared_and_per_request_context(wl: ModuleType, tok: object) -> None:
    cfg = wl.WorkloadConfig(num_tenants=1, prompt_tokens=(600,), sharing_ratio=0.5)
    (t,) = wl.build_workload(cfg, tok)
    p1 = t.system_prompt(random.Random(1), tok)
    p2 = t.system_prompt(random.Random(2), tok)
    assert p1.startswith(t.shared_prompt) and p2.startswith(t.shared_prompt) and p1 != p2
    assert abs(len(tok.encode(t.shared_prompt)) - 300) <= 2
    assert abs(len(tok.encode(p1)) - 600) <= 6


def test_api_keys_file_formats_and_bad_configs(wl: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "k.json").write_text(json.dumps({"a": "sk-1", "b": "sk-2"}))
    (tmp_path / "k.txt").write_text("# comment\na sk-1\nb sk-2\n")
    assert wl.read_api_keys(tmp_path / "k.json") == wl.read_api_keys(tmp_path / "k.txt") == {"a": "sk-1", "b": "sk-2"}
    with pytest.raises(ValueError):
        wl.WorkloadConfig(num_tenants=3, api_keys={"a": "x"})
    with pytest.raises(ValueError):
        wl.WorkloadConfig(sharing_ratio=1.5)
    with pytest.raises(ValueError):
        wl.parse_lengths("512,abc")


def _rec(ok: bool, ttft: float, e2e: float, out: int, cached: int, prompt: int = 100) -> dict:
    return {"tenant": "t0", "proto": "http", "start": 0.0, "ok": ok, "error": None if ok else "boom",
            "ttft": ttft, "tpot": (e2e - ttft) / (out - 1), "e2e": e2e, "prompt_tokens": prompt,
            "cached_tokens": cached, "output_tokens": out}


def test_summary_counts_failures_and_cache_ratios() -> None:
    recs = [_rec(True, 0.1, 1.1, 11, 80), _rec(True, 0.3, 2.3, 11, 60), _rec(False, 0.0, 0.5, 0, 0)]
    samples = [Sample(t=0, cache_hits=10, cache_queries=100), Sample(t=10, cache_hits=150, cache_queries=300)]
    s = summarize(recs, samples, run_s=10.0)
    assert s["requests"] == 3 and s["failed"] == 1 and s["errors"] == {"boom": 1}
    assert s["cached_token_ratio"] == pytest.approx(140 / 200)
    assert s["server"]["prefix_cache_hit_rate"] == pytest.approx(140 / 200)
    assert s["tpot_ms"]["mean"] == pytest.approx(150.0)
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)


def test_soak_verdict_flags_rss_growth_and_leaked_kv_chunks() -> None:
    def smp(t: float, rss: float, used: float) -> Sample:
        return Sample(t=t, rss_mb={"1": rss}, workers={"w": {"kv_chunks_used": used}})

    good = [smp(0, 100, 0), smp(5, 100, 40), smp(20, 102, 40), smp(40, 103, 0)]
    v = soak_verdict(good, load_start_t=1.0, warmup_s=10.0)
    assert v.passed and v.rss_growth["1"] == pytest.approx(1 / 102)
    leaky = [smp(0, 100, 0), smp(20, 100, 40), smp(40, 110, 3)]
    v = soak_verdict(leaky, load_start_t=1.0, warmup_s=10.0)
    assert not v.passed and not v.rss_ok and not v.kv_ok


def test_parse_metrics_sums_tenants_and_reads_worker_series() -> None:
    text = (
        '# TYPE chunkserve:prefix_cache_hits counter\n'
        'chunkserve:prefix_cache_hits_total{model_name="m",tenant="a"} 5.0\n'
        'chunkserve:prefix_cache_hits_total{model_name="m",tenant="b"} 7.0\n'
        '# TYPE chunkserve:worker_kv_chunks_used gauge\n'
        'chunkserve:worker_kv_chunks_used{model_name="m",worker_id="w1"} 12.0\n')
    totals, workers = parse_metrics(text)
    assert totals["cache_hits"] == 12.0
    assert workers == {"w1": {"kv_chunks_used": 12.0}}


def test_generated_tenants_file_carries_an_admin_key_for_metrics(tmp_path) -> None:
    """Tenant mode refuses /metrics to tenants' keys: the load test's sampler reads it with its own admin key."""
    from chunkserve.router.tenants import load_tenants
    from chunkserve.tools.loadtest_cluster import Endpoints, admin_key, write_tenants

    tenants_path, keys_path = write_tenants(tmp_path, 3)
    reg = load_tenants(str(tenants_path))
    admin = admin_key(Endpoints("http://x", "x:1", str(keys_path), local=True))
    assert admin is not None and reg.is_admin(f"Bearer {admin}")
    keys = json.loads(keys_path.read_text())
    assert len(keys) == 3 and not any(reg.is_admin(f"Bearer {k}") for k in keys.values())


def test_tenant_rates_split_the_poisson_rate_by_tenant_and_reject_bad_lists(wl: ModuleType) -> None:
    rates = wl.parse_rates("10,1", 2)
    assert rates == (10.0, 1.0)
    assert wl.parse_rates("", 3) == (1.0, 1.0, 1.0)
    assert wl.parse_rates("2,1", 4) == (2.0, 1.0, 2.0, 1.0)  # round-robin like --prompt-tokens
    users = 6  # users 0, 2, 4 -> tenant 0 (heavy); 1, 3, 5 -> tenant 1 (light)
    per_user = [wl.user_rate(16.5, rates, u % 2, users) for u in range(users)]
    assert sum(per_user[0::2]) == pytest.approx(15.0) and sum(per_user[1::2]) == pytest.approx(1.5)
    assert wl.user_rate(16.5, (1.0, 0.0), 1, users) == 0.0  # a silent tenant
    assert wl.user_rate(5.0, (1.0, 1.0, 1.0), 2, 2) == 0.0  # a tenant without users
    for bad in ("1,x", "0,0", "-1,2", "inf", "nan"):
        with pytest.raises(ValueError):
            wl.parse_rates(bad, 2)


def test_loadspec_refuses_bad_tenant_rates_before_any_cluster_starts() -> None:
    from chunkserve.tools.loadtest import LoadSpec

    with pytest.raises(ValueError, match="tenant rates"):
        LoadSpec(tenants=2, tenant_rates="0,0")
    assert LoadSpec(tenants=2, tenant_rates="10,1").tenant_rates == "10,1"
