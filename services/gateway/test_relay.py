"""The relay's writes of a running request's state to Redis: at most one per interval, in order,
nothing lost between them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from common.platform.store import Store
from services.gateway.relay import RouterRelay
from services.gateway.requests import GenerationRequest


@pytest.mark.parametrize("interval", [0.0, 0.25])
def test_request_state_is_written_at_most_once_per_interval(redis_url, redis_prefix, interval):
    async def body():
        store = Store.from_url(redis_url, prefix=redis_prefix)
        app = SimpleNamespace(
            settings=SimpleNamespace(request_state_interval_s=interval),
            store=store,
            tokenizer=SimpleNamespace(decode=lambda ids, **_: ""),
        )
        gen = GenerationRequest(request_id="req", prompt_ids=(1, 2), max_new_tokens=8)
        await store.create_request("req", [1, 2], gen.params(), owner="gw")
        relay = RouterRelay(app, gen, timeout_s=10)
        seen = []
        try:
            for now, ids in ((0.0, [5]), (0.1, [6]), (0.2, [7, 8]), (0.3, [9]), (0.4, [10])):
                assert await relay._save(ids, now)
                seen.append((await store.get_request("req"))["tokens"])
        finally:
            await store.close()
        return seen

    seen = asyncio.run(body())
    if interval == 0:
        assert seen == [[5], [5, 6], [5, 6, 7, 8], [5, 6, 7, 8, 9], [5, 6, 7, 8, 9, 10]]
    else:  # the first chunk at once, then what came since whenever the interval has passed
        assert seen == [[5], [5], [5], [5, 6, 7, 8, 9], [5, 6, 7, 8, 9]]
