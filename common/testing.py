"""Pytest fixtures shared by every test in the project (loaded from the root conftest.py).

- ``redis_server``: a real redis-server on a free loopback port for the whole session.
- ``redis_url``: its URL; ``store``: a fresh :class:`common.store.Store` on a unique prefix.
- ``tiny_zoo``: the ``tiny`` model zoo (:class:`cosine_zoo.manifest.Zoo`), built once per session.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

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


@pytest.fixture(scope="session")
def tiny_zoo(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real zoo (tokenizer, target, drafters, zoo.json) of the ``tiny`` profile, built in seconds."""
    from cosine_zoo.build import BuildOptions, build_zoo
    from cosine_zoo.profiles import tiny

    # one thread: as fast for models this small, and immune to a busy machine's oversubscription
    out = tmp_path_factory.mktemp("tiny-zoo")
    return build_zoo(BuildOptions(out=out, profile=tiny(), seed=0, progress=False, threads=1))
