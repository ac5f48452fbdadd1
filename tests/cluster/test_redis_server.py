from __future__ import annotations

import redis

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
