"""/dashboard in a real browser: headless Chromium (Debian's ``chromium``, driven by Playwright) against the
real application under Ray Serve and Redis, as ``chunkserve up`` deploys it (two tiny workers).

Two tenants share a group prompt, a third sends a private one; the page, opened with the admin key, must
draw the shared run with both tenants' references, the private run under its own scope and a hit-rate
chart with points; a tenant's key is refused. The screenshot goes to the test's tmp dir, and to
``docs/dashboard.png`` with ``CHUNKSERVE_UPDATE_SCREENSHOT=1``.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from chunkserve.client import HTTPClient
from chunkserve.cluster.redis_server import RedisServer
from chunkserve.cluster.redis_server import (
    find_free_port as _free_port,  # outside Ray's and the kernel's ports
)
from chunkserve.router.tenants import hash_api_key

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

MODEL = "tiny-dash"
CHROMIUM = os.environ.get("CHUNKSERVE_CHROMIUM", "/usr/bin/chromium")
SHARED = list(range(1000, 1000 + 96))  # 6 chunks of 16: the group's system prompt (token ids)
PRIVATE = list(range(5000, 5000 + 64))
DOCS = Path(__file__).resolve().parents[2] / "docs"


def _need_browser() -> None:
    ok = shutil.which(CHROMIUM) is not None or Path(CHROMIUM).exists()
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        ok = False
    if not ok:
        if os.environ.get("CI"):
            pytest.fail("CI needs chromium and playwright (scripts/setup.sh installs both)")
        pytest.skip("no chromium / playwright here (bash scripts/setup.sh dev installs them)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    _need_browser()
    from ray.serve.config import HTTPOptions

    from chunkserve.router.app import AppConfig, build_app

    tenants = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({
        "tenants": [{"id": t, "api_key_sha256": [hash_api_key(f"sk-{t}")], "cache_scope": scope}
                    for t, scope in (("acme", "shared:grp"), ("globex", "shared:grp"), ("initech", "private"))],
        "admin_api_key_sha256": [hash_api_key("sk-admin")]}))
    port = _free_port()
    with RedisServer() as redis:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options=HTTPOptions(host="127.0.0.1", port=port))
            cfg = AppConfig(model="random:tiny", model_name=MODEL, workers=2, ingress_replicas=1,
                            redis_url=redis.url, namespace="dash", tenants=str(tenants),
                            engine={"chunk_size": 16, "num_kv_chunks": 128, "max_model_len": 512})
            serve.run(build_app(cfg), name="dash", route_prefix="/")
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()
            ray.shutdown()


def _traffic(base: str) -> None:
    for i in range(3):
        for t in ("acme", "globex"):
            HTTPClient(base, api_key=f"sk-{t}", model=MODEL, timeout=60).complete(
                SHARED + [300 + 10 * i + len(t)], max_tokens=2, temperature=0.0)
    HTTPClient(base, api_key="sk-initech", model=MODEL, timeout=60).complete(PRIVATE + [7], max_tokens=2,
                                                                               temperature=0.0)


def test_dashboard_draws_the_forest_and_hit_rate_and_refuses_a_tenant_key(cluster: str, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    _traffic(cluster)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            t0 = time.perf_counter()
            page.goto(cluster + "/dashboard", wait_until="load")
            load_s = time.perf_counter() - t0
            page.fill("#key", "sk-admin")
            page.click("#auth button")
            # forest summaries are written every 2 s; the page refreshes every 3 s
            shared = page.locator('g.run[data-scope="shared:grp"][data-tenants="acme,globex"]')
            shared.first.wait_for(timeout=30_000)
            page.locator('g.run[data-scope="private:initech"][data-tenants="initech"]').first.wait_for(
                timeout=30_000)
            page.wait_for_function("document.querySelectorAll('#hitrate circle.pt').length >= 2",
                                   timeout=30_000)
            assert int(shared.first.get_attribute("data-tokens")) >= 96
            assert page.locator('g.run[data-scope="private:initech"][data-tenants*="acme"]').count() == 0
            routing = page.locator("#routing tbody").inner_text()
            assert "prefix_hit" in routing
            tenants = page.locator("#tenants tbody").inner_text()
            assert "acme" in tenants and "initech" in tenants
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            if os.environ.get("CHUNKSERVE_UPDATE_SCREENSHOT") == "1":
                shutil.copy(shot, DOCS / "dashboard.png")
            print(f"\n/dashboard loaded in {1000 * load_s:.0f} ms")
            assert load_s < 2.0  # target < 1 s locally (measured 0.2-0.85 s on a loaded 2-core machine)

            refused = browser.new_page()
            refused.goto(cluster + "/dashboard")
            # the keyless first refresh is refused (401); entering a key must replace that verdict
            refused.wait_for_function("document.body.dataset.state === 'refused'", timeout=15_000)
            assert "401" in refused.locator("#status").inner_text()
            refused.fill("#key", "sk-acme")
            refused.click("#auth button")
            refused.wait_for_function("document.body.dataset.state === 'refused'", timeout=15_000)
            assert "403" in refused.locator("#status").inner_text()
            assert refused.locator("g.run").count() == 0
        finally:
            browser.close()
