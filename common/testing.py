"""Pytest fixtures shared by every test in the project (loaded from the root conftest.py).

- ``redis_server``: a real redis-server on a free loopback port for the whole session.
- ``redis_url``: its URL; ``store``: a fresh :class:`common.store.Store` on a unique prefix.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from common.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture()
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture()
def redis_prefix() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"
