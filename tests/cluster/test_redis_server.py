from __future__ import annotations

import contextlib
import socket

import redis

from chunkserve.cluster import redis_server
from chunkserve.cluster.redis_server import RedisServer


def test_server_answers_ping_and_stops_cleanly() -> None:
    srv = RedisServer()
    with srv:
        client = redis.Redis.from_url(srv.url)
        assert client.ping()
        assert client.config_get("save")["save"] == ""
        assert client.config_get("appendonly")["appendonly"] == "no"
        client.close()
    assert not srv.running
    try:
        redis.Redis.from_url(srv.url, socket_connect_timeout=0.2).ping()
        raise AssertionError("server still answers after stop()")
    except redis.ConnectionError:
        pass


def test_restart_reuses_the_port_with_empty_data() -> None:
    with RedisServer() as srv:
        client = redis.Redis.from_url(srv.url)
        client.set("k", "v")
        srv.stop()
        srv.start()
        assert srv.running
        assert client.get("k") is None  # no persistence
        client.close()


def test_free_ports_come_from_below_the_ephemeral_range_and_can_be_bound() -> None:
    low = redis_server._ephemeral_low()
    ports = {redis_server.find_free_port() for _ in range(20)}
    assert all(redis_server.LOW_PORT <= p < low for p in ports)  # outgoing connections never get these
    assert len(ports) > 1  # random, not one fixed port
    for p in list(ports)[:3]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_server_survives_a_ctrl_c_sent_to_its_parents_process_group() -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    # a child in a process group of its own (as a terminal's foreground job) starts a server, then gets the
    # group's SIGINT: the server must still answer until the child stops it
    code = ("import signal, sys, time\n"
            "from chunkserve.cluster.redis_server import RedisServer\n"
            "signal.signal(signal.SIGINT, lambda *a: None)\n"
            "srv = RedisServer().start()\n"
            "print(srv.url, flush=True)\n"
            "sys.stdin.readline()\n"
            "srv.stop()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        url = proc.stdout.readline().strip()
        os.killpg(proc.pid, signal.SIGINT)
        client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        for _ in range(5):  # a server that took the SIGINT is gone within a fraction of a second
            assert client.ping()
            time.sleep(0.1)
        client.close()
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_server_stops_when_its_parent_is_killed_with_sigkill() -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    import pytest

    from chunkserve.cluster.redis_server import _pdeathsig_prefix

    if not _pdeathsig_prefix():
        pytest.skip("no setpriv --pdeathsig here (Linux with util-linux only)")
    # a parent killed with SIGKILL runs no exit handler: the kernel's parent-death signal must stop its server
    code = ("import sys\n"
            "from chunkserve.cluster.redis_server import RedisServer\n"
            "srv = RedisServer().start()\n"
            "print(srv.url, srv._proc.pid, flush=True)\n"
            "sys.stdin.readline()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    url, pid = proc.stdout.readline().split()
    client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    try:
        assert client.ping()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                client.ping()
            except redis.ConnectionError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("redis-server still answers 10 s after its parent was killed")
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)  # on failure: leave no server behind
