"""The real application on a two-node Ray cluster on one machine: the closest this box gets to the GPU
cluster that ``serve deploy`` targets.

``ray start --head`` and ``ray start --address`` run as subprocesses (each ``--block``, in its own process
group, with its own temp dir and ports); each node offers one ``worker_slot`` resource and the app asks
for one per worker (``AppConfig.worker_resources``), so the two ``random:tiny`` workers land on different
nodes. Tenants are served over HTTP (proxy on the head node only) and routed by prefix through the Redis
index. The nodes are stopped at the end by their process ids, even on failure (never ``ray stop``, which
would stop every Ray on the machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from chunkserve.client import HTTPClient
from chunkserve.cluster.hashing import hash_chain
from chunkserve.cluster.index import PrefixIndex
from chunkserve.cluster.redis_server import RedisServer
from chunkserve.cluster.redis_server import (
    find_free_port as _free_port,  # outside Ray's and the kernel's ports
)
from chunkserve.router.policy import rendezvous_weight
from chunkserve.router.tenants import hash_api_key

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

pytestmark = pytest.mark.slow

MODEL = "tiny-2nodes"
NS = "twonodes"  # Redis namespace of the app's index (AppConfig.namespace)
CHUNK = 16
SYS_TOKENS = 256
TENANTS = ["acme", "globex", "initech"]
# Ray's token auth: the nodes must use the mode this (driver) process is in. That is "disabled" in a fresh
# process, and "token" (with ~/.ray/auth_token) once a local ray.init in this process enabled it: Ray then
# sets RAY_AUTH_MODE here, and the mode it read cannot be changed back within the process.
AUTH_ENV = "RAY_AUTH_MODE"
RAY = str(Path(__file__).resolve().parents[2] / ".venv" / "bin" / "ray")


def _ports() -> list[str]:
    """Per-node ports, so two nodes (and other Ray clusters on the machine) never collide."""
    opts = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
            "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")
    return [a for o in opts for a in (o, str(_free_port()))]


class Node:
    """One ``ray start --block`` subprocess in its own process group and temp dir."""

    def __init__(self, name: str, args: list[str]) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix=f"cs{name}", dir="/tmp")  # short: Ray puts sockets here
        self.log = open(Path(self.temp_dir) / "ray_start.log", "w")  # noqa: SIM115 (closed in stop())
        cmd = [RAY, "start", "--block", "--disable-usage-stats", "--temp-dir", self.temp_dir,
               "--object-store-memory", str(100 * 1024 * 1024), *_ports(), *args]
        env = {**os.environ, AUTH_ENV: os.environ.get(AUTH_ENV) or "disabled"}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def stop(self) -> None:
        """SIGTERM the node (Ray kills its processes), then SIGKILL its process group and stragglers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        for pid in _pids_mentioning(self.temp_dir):  # workers that left the process group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _pids_mentioning(text: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if text in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


def _wait_nodes(n: int, timeout_s: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [x for x in ray.nodes() if x["Alive"]]
        if len(alive) >= n or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[str]:
    """-> the GCS address of a running two-node cluster (node_a: head, node_b: joined)."""
    port = _free_port()
    ip = ray.util.get_node_ip_address()  # what Ray resolves a local address to anyway
    address = f"{ip}:{port}"
    nodes = [Node("a", ["--head", "--port", str(port), "--include-dashboard",
                        "false", "--ray-client-server-port", str(_free_port()), "--num-cpus", "1",
                        "--resources", json.dumps({"node_a": 1, "worker_slot": 1})])]
    try:
        _wait_for_gcs(ip, port, nodes[0], timeout_s=120)
        nodes.append(Node("b", ["--address", address, "--num-cpus", "1",
                                "--resources", json.dumps({"node_b": 1, "worker_slot": 1})]))
        _wait_for_start(nodes[1], timeout_s=120)
        yield address
    finally:
        for node in reversed(nodes):
            node.stop()


def _wait_for_start(node: Node, timeout_s: float) -> None:
    """Until ``ray start`` says the node runs; a node that exits or never says so fails with its log."""
    deadline = time.monotonic() + timeout_s
    log = Path(node.log.name)
    while time.monotonic() < deadline:
        node.log.flush()
        if "Ray runtime started" in log.read_text(errors="replace"):
            return
        if node.proc.poll() is not None:
            break
        time.sleep(0.5)
    raise RuntimeError(f"ray start (joining node) did not start: {log.read_text(errors='replace')[-2000:]}")


def _wait_for_gcs(ip: str, port: int, head: Node, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.proc.poll() is not None:
            raise RuntimeError(f"ray start --head exited: {Path(head.log.name).read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex((ip, port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError("the head node's GCS never came up")


@pytest.fixture(scope="module")
def app(two_nodes: str, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[str]:
    """-> the HTTP base URL of the app deployed over both nodes."""
    from ray.serve.config import HTTPOptions, ProxyLocation

    from chunkserve.router.app import AppConfig, build_app

    tenants = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"tenants": [
        {"id": t, "api_key_sha256": [hash_api_key(f"sk-{t}")]} for t in TENANTS]}))
    try:
        ray.init(address=two_nodes, log_to_driver=False)
        alive = _wait_nodes(2, timeout_s=90)
        assert len(alive) == 2, f"{len(alive)} node(s) joined"
        port = _free_port()
        serve.start(proxy_location=ProxyLocation.HeadOnly, http_options=HTTPOptions(host="127.0.0.1", port=port))
        cfg = AppConfig(model="random:tiny", model_name=MODEL, workers=2, redis_url=redis_server.url,
                        namespace=NS, tenants=str(tenants), worker_resources={"worker_slot": 1},
                        engine={"chunk_size": CHUNK, "num_kv_chunks": 128, "max_model_len": 512})
        serve.run(build_app(cfg), name="chunkserve", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()


def _worker_stats() -> dict[str, dict[str, Any]]:
    handle = serve.get_deployment_handle("Worker", app_name="chunkserve")
    out: dict[str, dict[str, Any]] = {}
    for _ in range(20):
        st = handle.stats.remote().result(timeout_s=30)
        out[st["worker_id"]] = st
        if len(out) == 2:
            break
    return out


def _system_prompts(workers: list[str]) -> dict[str, list[int]]:
    """A distinct system prompt per tenant, drawn so that the (cold) prefixes' rendezvous owners take turns
    over the workers: the router then places tenants on both nodes."""
    rng = random.Random(3)
    prompts = {}
    for i, t in enumerate(TENANTS):
        while t not in prompts:
            ids = [rng.randrange(300, 40_000) for _ in range(SYS_TOKENS)]
            first = hash_chain(ids[:CHUNK], CHUNK, t.encode())[0]  # private scope: salted by the tenant id
            if max(workers, key=lambda w, h=first: rendezvous_weight(h, w)) == workers[i % len(workers)]:
                prompts[t] = ids
    return prompts


def test_workers_on_both_nodes_serve_tenants_routed_by_prefix(app: str, redis_server: RedisServer) -> None:
    stats = _worker_stats()
    node_ids = {x["NodeID"]: x["Resources"] for x in ray.nodes() if x["Alive"]}
    assert len(stats) == 2
    worker_nodes = {w: s["node_id"] for w, s in stats.items()}
    assert len(set(worker_nodes.values())) == 2, f"both workers on one node: {worker_nodes}"
    assert {r for n in worker_nodes.values() for r in node_ids[n]} >= {"node_a", "node_b"}

    prompts = _system_prompts(sorted(stats))
    order = TENANTS + random.Random(3).choices(TENANTS, k=12)
    seen: set[str] = set()
    for i, t in enumerate(order):
        client = HTTPClient(app, api_key=f"sk-{t}", model=MODEL, timeout=60)
        out = client.complete(prompts[t] + [40_001 + i, 40_002 + i], max_tokens=3, temperature=0.0)
        assert out["choices"][0]["finish_reason"] in ("length", "stop")
        assert out["usage"]["completion_tokens"] >= 1
        cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (SYS_TOKENS if t in seen else 0), f"request {i} ({t}): {cached} cached tokens"
        seen.add(t)
    # A wrong key is refused on this cluster as anywhere.
    with pytest.raises(Exception, match="401"):
        HTTPClient(app, api_key="sk-nobody", model=MODEL, timeout=60).complete([1, 2, 3], max_tokens=1)

    time.sleep(0.3)  # the last publish lands
    idx = PrefixIndex(redis_server.url, namespace=NS)
    try:
        assert set(idx.live_workers()) == set(stats)
        holders = {t: {w for w, n in idx.longest_prefixes(hash_chain(p, CHUNK, t.encode()), stats).items()
                       if n == SYS_TOKENS // CHUNK} for t, p in prompts.items()}
    finally:
        idx.close()
    assert all(len(h) == 1 for h in holders.values()), holders  # each tenant on one worker
    assert {w for h in holders.values() for w in h} == set(stats)  # and both nodes served tenants
    after = _worker_stats()
    assert sum(s["prefix_cached_tokens"] for s in after.values()) == SYS_TOKENS * (len(order) - len(TENANTS))
    print(f"\ntenants -> node: { {t: worker_nodes[next(iter(h))][:8] for t, h in holders.items()} }")
