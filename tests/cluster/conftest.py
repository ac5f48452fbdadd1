"""Fixtures: one real redis-server per test module (never fakeredis)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from chunkserve.cluster.redis_cluster import RedisClusterServer
from chunkserve.cluster.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def namespace() -> str:
    """A fresh key namespace per test, so tests sharing a server never see each other's keys."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterServer]:
    """A real three-node Redis Cluster (`redis+cluster://` URL) for the module."""
    with RedisClusterServer() as rc:
        yield rc
