"""`chunkserve up` end to end, as a user runs it: a subprocess that starts Ray, a real Redis and the app,
serves HTTP and gRPC on the ports it prints (through Ray's proxy, or HAProxy with ``--front haproxy``),
reuses a repeated prompt's prefix, and stops cleanly on SIGTERM (Redis, Ray and the front gone, exit
status 0)."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx2
import pytest

from chunkserve.client import GrpcClient, HTTPClient
from chunkserve.cluster.redis_server import (
    find_free_port as _free_port,  # outside Ray's and the kernel's ports
)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _reader(proc: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put(line)


def _listeners(port: int) -> set[str]:
    """Names of the processes listening on ``port`` (this machine)."""
    import psutil

    names = set()
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
            with contextlib.suppress(psutil.Error):
                names.add(psutil.Process(c.pid).name())
    return names


@pytest.mark.parametrize("front", ["ray", "haproxy"])
def test_chunkserve_up_serves_http_and_grpc_then_stops_cleanly_on_sigterm(tmp_path: Path, front: str) -> None:
    http_port, grpc_port = _free_port(), _free_port()
    cmd = [sys.executable, "-c", "import sys; from chunkserve.cli import main; sys.exit(main())", "up",
           "--front", front, "--workers", "1", "--model", "random:tiny", "--num-cpus", "2", "--proxy-location", "HeadOnly",
           "--http-port", str(http_port), "--grpc-port", str(grpc_port),
           "--engine", '{"chunk_size": 16, "num_kv_chunks": 256, "max_model_len": 512}']
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                            start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_reader, args=(proc, lines), daemon=True).start()
    out: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not any("Ctrl-C to stop." in x for x in out):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("chunkserve up did not come up:\n" + "".join(out)[-4000:])
            with contextlib.suppress(queue.Empty):
                out.append(lines.get(timeout=1))
        banner = "".join(out)
        assert f"http://127.0.0.1:{http_port}/v1" in banner and f"127.0.0.1:{grpc_port}" in banner
        redis_url = next(x.split(": ", 1)[1].strip() for x in out if "Redis prefix index:" in x)
        held_by = _listeners(http_port) | _listeners(grpc_port)
        assert held_by == ({"haproxy"} if front == "haproxy" else {"ray::ProxyActor"}), held_by

        http = HTTPClient(f"http://127.0.0.1:{http_port}", timeout=60)
        assert http.health()
        ready = httpx2.get(f"http://127.0.0.1:{http_port}/ready", timeout=30)  # "up": every worker runs
        assert ready.status_code == 200 and ready.json()["ready"] is True and ready.json()["workers"] == 1
        prompt = list(range(1, 100))  # six full 16-token chunks: the repeat is routed to its cached prefix
        first = http.complete(prompt, max_tokens=4, temperature=0.0)
        again = http.complete(prompt, max_tokens=4, temperature=0.0)
        assert first["choices"][0]["text"] == again["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96
        with GrpcClient(f"127.0.0.1:{grpc_port}") as rpc:
            resp = rpc.generate(prompt_token_ids=prompt, max_tokens=4, temperature=0.0)
        assert resp.text == first["choices"][0]["text"]
        # bytes that are not a GenerateRequest get INVALID_ARGUMENT from the ingress, behind either front
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            raw = ch.unary_unary("/chunkserve.v1.ChunkServe/Generate", request_serializer=None,
                                 response_deserializer=None)
            with pytest.raises(grpc.RpcError) as garbage:
                raw(b"\xff\xff\xff\x0f garbage", metadata=(("application", "chunkserve"),), timeout=30)
        assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    time.sleep(0.5)
    while not lines.empty():
        out.append(lines.get())
    assert "chunkserve stopped." in "".join(out)
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as s:  # the Redis it started is gone
        assert s.connect_ex(("127.0.0.1", port)) != 0
    assert not _listeners(http_port) and not _listeners(grpc_port)  # and whatever took the client ports
