"""Tenants config, authentication and rate limiting (pure, no server)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from chunkserve.router.ratelimit import RateLimited, RateLimiter, TokenBucket
from chunkserve.router.tenants import (
    AuthError,
    TenantRegistry,
    bearer_key,
    hash_api_key,
    load_tenants,
    main,
    parse_tenants,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "tenants.example.yaml"


class FakeClock:
    """A manual clock (time is an input of the limiter, not a stubbed result)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _cfg(**over):
    base = {"id": "a", "api_key_sha256": [hash_api_key("key-a")]}
    base.update(over)
    return {"tenants": [base]}


def test_hash_api_key_is_sha256_hex():
    assert hash_api_key("sk-1") == hashlib.sha256(b"sk-1").hexdigest()
    with pytest.raises(ValueError):
        hash_api_key("")


def test_example_file_loads_and_its_documented_keys_authenticate():
    reg = load_tenants(EXAMPLE)
    assert set(reg.tenants) == {"acme", "globex", "initech", "umbrella"}
    assert reg.authenticate_header("Bearer sk-acme-example").id == "acme"
    assert reg.authenticate_header("bearer sk-globex-example").id == "globex"
    assert reg.tenants["initech"].cache_salt == reg.tenants["umbrella"].cache_salt == b"helpdesk"
    assert reg.tenants["acme"].cache_salt == b"acme" != reg.tenants["globex"].cache_salt


def test_unknown_or_missing_key_is_rejected():
    reg = TenantRegistry(parse_tenants(_cfg()))
    for header in (None, "", "Bearer ", "Bearer key-b", "Basic a2V5LWE=", "Bearer key-a "[:-2]):
        with pytest.raises(AuthError):
            reg.authenticate_header(header)
    assert reg.authenticate_header("Bearer key-a").id == "a"
    assert reg.authenticate_metadata([("x", "1"), ("authorization", "Bearer key-a")]).id == "a"
    with pytest.raises(AuthError):
        reg.authenticate_metadata([("x", "1")])


def test_open_mode_has_one_public_tenant_and_logs_it(caplog):
    with caplog.at_level(logging.WARNING, logger="chunkserve.router.tenants"):
        reg = load_tenants(None)
    assert reg.open_mode and list(reg.tenants) == ["public"]
    assert reg.authenticate_header(None).id == "public"
    assert reg.authenticate_header("Bearer anything").id == "public"
    assert "open mode" in caplog.text


@pytest.mark.parametrize("bad", [
    {"tenants": []},
    _cfg(extra_field=1),
    _cfg(api_key_sha256=["sk-raw-key"]),
    _cfg(api_key_sha256=[]),
    _cfg(cache_scope="public"),
    _cfg(cache_scope="shared:"),
    _cfg(id="bad id"),
    _cfg(id="acme\n"),  # re.match with "$" let a trailing newline through
    _cfg(cache_scope="shared:grp\n"),
    _cfg(api_key_sha256=["0" * 64 + "\n"]),
    _cfg(max_concurrent_requests=0),
    _cfg(rate_limit={"requests_per_second": 0}),
    _cfg(rate_limit={"requests_per_second": float("inf")}),  # broke the limiter at start
    _cfg(rate_limit={"requests_per_second": float("nan")}),
    _cfg(rate_limit={"requests_per_second": 5e-324}),  # an infinite Retry-After: a 500 instead of a 429
    _cfg(rate_limit={"rps": 1}),
    _cfg(rate_limit={"burst_requests": 5}),
    {"tenants": [{"id": "a", "api_key_sha256": [hash_api_key("k")]},
                 {"id": "a", "api_key_sha256": [hash_api_key("l")]}]},
    {"tenants": [{"id": "a", "api_key_sha256": [hash_api_key("k")]},
                 {"id": "b", "api_key_sha256": [hash_api_key("k")]}]},
    {"tenants": [{"id": "a", "api_key_sha256": [hash_api_key("k")]},
                 {"id": "b", "api_key_sha256": [hash_api_key("l")], "cache_scope": "shared:a"}]},
])
def test_invalid_tenant_configs_are_rejected(bad):
    with pytest.raises(ValidationError):
        parse_tenants(bad)


def test_invalid_yaml_file_is_a_clear_error(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("tenants: [id: a\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_tenants(p)
    p.write_text(yaml.safe_dump(_cfg()))
    assert list(load_tenants(p).tenants) == ["a"]


def test_bearer_key_parsing():
    assert bearer_key("Bearer abc") == "abc"
    assert bearer_key("BEARER  abc ") == "abc"
    assert bearer_key("abc") == "abc"
    assert bearer_key("Bearer") == "Bearer"
    assert bearer_key(None) is None and bearer_key("  ") is None


def test_cli_hash_key_prints_the_digest(capsys):
    assert main(["hash-key", "sk-x"]) == 0
    assert capsys.readouterr().out.strip() == hash_api_key("sk-x")


def test_cli_check_and_hash_key_report_bad_input_without_a_traceback(tmp_path, capsys):
    assert main(["check", str(tmp_path / "missing.yaml")]) == 1
    assert "missing.yaml" in capsys.readouterr().err
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert main(["check", str(empty)]) == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"tenants": [{"id": "a", "api_key_sha256": ["not-a-hash"]}]}))
    assert main(["check", str(bad)]) == 1
    assert "api_key_sha256" in capsys.readouterr().err
    assert main(["hash-key", ""]) == 2


def test_token_bucket_refills_at_its_rate():
    clk = FakeClock()
    b = TokenBucket(rate=2.0, capacity=4, clock=clk)
    assert b.wait_time(4) == 0
    b.take(4)
    assert b.wait_time(1) == pytest.approx(0.5)
    clk.t += 1.0
    assert b.level() == pytest.approx(2.0)
    clk.t += 100
    assert b.level() == pytest.approx(4.0)  # capped
    assert b.wait_time(100) == 0  # amounts above the capacity pass once the bucket is full


def test_a_clock_stepped_back_does_not_drain_the_bucket():
    clk = FakeClock()
    clk.t = 3600.0
    b = TokenBucket(rate=20.0, capacity=4, clock=clk)
    clk.t -= 3600.0  # an hour back (an NTP step, another host's clock)
    assert b.level() == pytest.approx(4.0) and b.wait_time(1) == 0
    clk.t += 0.05
    assert b.level() == pytest.approx(4.0)


def _limiter(clk, **over):
    reg = TenantRegistry(parse_tenants(_cfg(**over)))
    return RateLimiter(reg.tenants, clock=clk)


def test_requests_per_second_limit_gives_retry_after():
    clk = FakeClock()
    lim = _limiter(clk, rate_limit={"requests_per_second": 2})
    lim.acquire("a").release()
    lim.acquire("a").release()
    with pytest.raises(RateLimited) as ei:
        lim.acquire("a")
    assert ei.value.retry_after == pytest.approx(0.5)
    assert ei.value.retry_after_header == "1"
    clk.t += 0.5
    lim.acquire("a").release()


def test_concurrency_limit_counts_running_requests():
    lim = _limiter(FakeClock(), max_concurrent_requests=2)
    a, b = lim.acquire("a"), lim.acquire("a")
    with pytest.raises(RateLimited, match="concurrent"):
        lim.acquire("a")
    a.release()
    a.release()  # idempotent: does not free a second slot
    c = lim.acquire("a")
    with pytest.raises(RateLimited):
        lim.acquire("a")
    b.release()
    c.release()
    assert lim.running("a") == 0


def test_tokens_per_minute_reserves_and_refunds_unused_tokens():
    clk = FakeClock()
    lim = _limiter(clk, rate_limit={"tokens_per_minute": 600})  # 10 tokens/s
    lease = lim.acquire("a")
    lease.charge_tokens(500)
    lease.release(actual_tokens=100)  # 400 refunded
    lease2 = lim.acquire("a")
    lease2.charge_tokens(500)  # 500 available again
    lease3 = lim.acquire("a")
    with pytest.raises(RateLimited, match="tokens/min") as ei:
        lease3.charge_tokens(200)
    assert ei.value.retry_after == pytest.approx(20.0)  # 200 tokens at 10 tokens/s
    assert lease3.released and lim.running("a") == 1  # the failed charge released its own lease
    lease2.release(actual_tokens=500)


def test_limiter_is_consistent_under_concurrent_tasks():
    lim = _limiter(FakeClock(), max_concurrent_requests=5)
    admitted: list[int] = []
    peak = 0

    async def one(i: int) -> None:
        nonlocal peak
        try:
            lease = lim.acquire("a")
        except RateLimited:
            return
        admitted.append(i)
        peak = max(peak, lim.running("a"))
        await asyncio.sleep(0.001 * (i % 3))
        lease.release()

    async def run() -> None:
        await asyncio.gather(*(one(i) for i in range(50)))

    asyncio.run(run())
    assert peak == 5 and lim.running("a") == 0 and len(admitted) >= 5
