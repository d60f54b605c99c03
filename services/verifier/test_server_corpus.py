"""The verifier service keeps the lookup corpus its plain steps draft from (``VerifyItem.step_corpus``):
loaded from Redis at start, and again whenever the routers' corpus is seeded anew."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from common.platform.store import Store
from services.verifier.server import VerifierApp
from services.verifier.settings import VerifierSettings


async def _proposal(engine: SimpleNamespace, wanted: list[int], timeout_s: float = 10.0) -> list[int]:
    """What the engine's corpus proposes after ``1 2`` in code, once it is ``wanted`` (or the timeout)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    got: list[int] = []
    while loop.time() < deadline:
        if engine.corpus is not None:
            got = engine.corpus.propose("code", [1, 2], 2)[0]
            if got == wanted:
                break
        await asyncio.sleep(0.05)
    return got


def test_the_verifier_loads_the_lookup_corpus_and_again_when_it_is_seeded_anew(redis_url, redis_prefix) -> None:
    async def body() -> tuple[list[int], list[int]]:
        store = Store.from_url(redis_url, prefix=redis_prefix)
        engine = SimpleNamespace(corpus=None)  # the app hands the corpus to its engine; no model needed for that
        app = VerifierApp(VerifierSettings(), store, engine)  # type: ignore[arg-type]
        try:
            await store.seed_corpus({"code": [[1, 2, 3, 4]]})
            await app.start(None, "")  # type: ignore[arg-type]
            first = await _proposal(engine, [3, 4])
            await store.seed_corpus(
                {"code": [[1, 2, 9, 9]]}
            )  # a new seed: the routers reload it, and so does the verifier
            second = await _proposal(engine, [9, 9])
        finally:
            await app.stop()
            await store.close()
        return first, second

    assert asyncio.run(body()) == ([3, 4], [9, 9])
