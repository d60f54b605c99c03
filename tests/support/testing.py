"""Pytest fixtures shared by every test in the project (loaded from the root conftest.py).

- ``redis_server``: a real redis-server on a free loopback port for the whole session.
- ``redis_url``: its URL; ``store``: a fresh :class:`common.platform.store.Store` on a unique prefix.
- ``tiny_zoo``: the ``tiny`` model zoo (:class:`cosine_zoo.manifest.Zoo`), built once per session.
- ``dev_certs``, ``other_certs``: two unrelated throwaway CAs, each with a service and a client
  certificate (:class:`common.platform.devcerts.DevCerts`), for TLS and mTLS tests.

Before the first test the project's CPU kernels are built (or found in the cache): on a fresh
machine that takes 30-60 s on two cores, which no test's start-up deadline should have to hold.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from cosine_cli.redis_server import RedisServer


@pytest.fixture(scope="session", autouse=True)
def _own_cpu_kernels_built() -> None:
    from common.runtime.streamed_linear import extension

    extension()  # None where they cannot be built: the tests that need them skip


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


class InProcessService:
    """Runs one service's full start-up path (``common.platform.service.serve``) on its own event loop in a
    background thread, bound to a free port. ``port`` is valid after start(); stop() shuts it down
    the way SIGTERM would."""

    def __init__(self, settings, factory, prog: str = "test-service"):
        self.settings = settings
        self.factory = factory
        self.prog = prog
        self.port = 0
        self.error: BaseException | None = None
        self._loop = None
        self._stop = None
        self._thread = None

    def start(self, timeout_s: float = 60.0) -> InProcessService:
        import asyncio
        import threading

        from common.platform.service import serve

        started = threading.Event()

        async def body() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            ready = asyncio.Event()
            task = asyncio.create_task(serve(self.settings, self.factory, self.prog, ready=ready, stop=self._stop))
            waiter = asyncio.create_task(ready.wait())
            done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if waiter in done:
                self.port = ready.port  # type: ignore[attr-defined]
            started.set()
            await task

        def run() -> None:
            try:
                asyncio.run(body())
            except BaseException as exc:  # surfaced to the test through start()/stop()
                self.error = exc
            finally:
                started.set()

        self._thread = threading.Thread(target=run, name=f"{self.prog}-loop", daemon=True)
        self._thread.start()
        started.wait(timeout_s)
        if self.error is not None:
            raise self.error
        if not self.port:
            raise RuntimeError(f"{self.prog} did not start within {timeout_s}s")
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, timeout_s: float = 15.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.error is not None:
            raise self.error

    def __enter__(self) -> InProcessService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_service(settings, factory, prog: str = "test-service") -> tuple[InProcessService, int]:
    """Start a service in-process on the port its settings give (use port=0): returns (server, port)."""
    server = InProcessService(settings, factory, prog).start()
    return server, server.port


@pytest.fixture(scope="session")
def dev_certs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from common.platform.devcerts import write_dev_certs

    return write_dev_certs(tmp_path_factory.mktemp("certs"), days=1)


@pytest.fixture(scope="session")
def other_certs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Certificates of another CA: valid PEM, the same names, trusted by nobody who trusts dev_certs."""
    from common.platform.devcerts import write_dev_certs

    return write_dev_certs(tmp_path_factory.mktemp("other-certs"), days=1)


@pytest.fixture(scope="session")
def tiny_zoo(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real zoo (tokenizer, target, drafters, zoo.json) of the ``tiny`` profile, built in seconds."""
    from cosine_zoo.build import BuildOptions, build_zoo
    from cosine_zoo.profiles import tiny

    # one thread: as fast for models this small, and immune to a busy machine's oversubscription
    out = tmp_path_factory.mktemp("tiny-zoo")
    return build_zoo(BuildOptions(out=out, profile=tiny(), seed=0, progress=False, threads=1))


@pytest.fixture(scope="session")
def tiny_distilled_zoo(tiny_zoo: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A zoo of the ``tiny-distill`` profile: drafters with a reduced draft vocabulary, distilled
    from the tiny zoo's target by the same pipeline that builds ``smol``."""
    from cosine_zoo.build import BuildOptions, build_zoo
    from cosine_zoo.profiles import tiny_distill

    out = tmp_path_factory.mktemp("tiny-distilled-zoo")
    return build_zoo(
        BuildOptions(out=out, profile=tiny_distill(), seed=0, progress=False, threads=1, target=tiny_zoo.target.path)
    )
