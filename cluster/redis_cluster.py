"""A real Redis Cluster of ``redis-server`` processes on loopback, for tests and trying cluster mode locally.

Three primaries (no replicas) by default, the 16,384 hash slots split evenly among them, formed with plain
``CLUSTER ADDSLOTSRANGE`` / ``CLUSTER MEET`` commands (no ``redis-cli`` needed). Its `url` uses the
``redis+cluster://`` scheme, which makes every chunkserve Redis client (`cluster.index.redis_client`) a
cluster client::

    with RedisClusterServer() as rc:
        WorkerPublisher(rc.url, "w1")
"""

from __future__ import annotations

import contextlib
import time
from types import TracebackType

import redis

from chunkserve.cluster.redis_server import RedisServer, find_free_port

SLOTS = 16384


class RedisClusterServer:
    """Owns ``nodes`` cluster-enabled ``redis-server`` children that form one cluster."""

    def __init__(self, nodes: int = 3, host: str = "127.0.0.1", startup_timeout_s: float = 20.0) -> None:
        if nodes < 1:
            raise ValueError(f"a cluster needs at least one node, got {nodes}")
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.servers = [self._node() for _ in range(nodes)]

    def _node(self) -> RedisServer:
        # the bus port is picked too: by default it is port + 10000, which may be taken (by another node's port)
        return RedisServer(host=self.host, extra_args=(
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
            "--cluster-port", str(find_free_port(self.host))))

    @property
    def url(self) -> str:
        """``redis+cluster://host:port`` of the first node (a cluster client discovers the others)."""
        return f"redis+cluster://{self.host}:{self.servers[0].port}"

    def start(self) -> RedisClusterServer:
        """Start every node, give each its share of the slots, join them and wait for ``cluster_state:ok``."""
        try:
            for i in range(len(self.servers)):
                for attempt in range(3):  # a port picked free may be taken before the server binds it
                    try:
                        self.servers[i].start()
                        break
                    except RuntimeError:
                        if attempt == 2:
                            raise
                        self.servers[i] = self._node()
            clients = [redis.Redis(host=self.host, port=s.port, socket_timeout=2.0) for s in self.servers]
            n = len(clients)
            for i, c in enumerate(clients):
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * SLOTS // n, (i + 1) * SLOTS // n - 1)
            for s in self.servers[1:]:
                clients[0].execute_command("CLUSTER", "MEET", self.host, s.port, _bus_port(s))
            deadline = time.monotonic() + self.startup_timeout_s
            while not all(_ready(c, n) for c in clients):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Redis Cluster of {n} nodes did not form within {self.startup_timeout_s} s")
                time.sleep(0.05)
            for c in clients:
                c.close()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every node."""
        for s in self.servers:
            s.stop()

    def __enter__(self) -> RedisClusterServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _bus_port(server: RedisServer) -> int:
    args = server.extra_args
    return int(args[args.index("--cluster-port") + 1])


def _ready(client: redis.Redis, nodes: int) -> bool:
    """Whether ``client``'s node sees the whole cluster as up (every slot served, every node known)."""
    with contextlib.suppress(redis.RedisError):
        info = client.execute_command("CLUSTER", "INFO")
        text = info.decode() if isinstance(info, bytes) else str(info)
        fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
        return fields.get("cluster_state") == "ok" and int(fields.get("cluster_known_nodes", 0)) == nodes
    return False
