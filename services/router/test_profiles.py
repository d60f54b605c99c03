"""The router's profile access across a real Redis outage: reads fall back to no priors, writes
are summed and land once Redis is back."""

from __future__ import annotations

import asyncio

import pytest

from common.platform.store import Store
from cosine_cli.redis_server import RedisServer
from services.router.profiles import ProfileStore


def test_profiles_ride_out_a_redis_restart():
    async def body(server: RedisServer):
        store = Store.from_url(server.url, prefix="p")
        try:
            profiles = ProfileStore(store)
            await store.seed_profile("code", {"code": 2.0}, prior_weight=10)
            await profiles.record([("code", "code", 1.0, 4.0)])
            assert await profiles.priors(["code"], "code") == {"code": pytest.approx((2.0 * 10 + 1.0) / 11)}

            server.kill()
            assert await profiles.priors(["code"], "code") == {}  # no priors, no exception
            await profiles.record([("code", "code", 2.0, 4.0), ("code", "code", 3.0, 4.0)])
            await profiles.record([("prose", "code", 1.0, 2.0)])
            assert profiles.failed_writes == 2

            server.start()
            await profiles.record([("code", "code", 0.0, 4.0)])  # carries the backlog
            return (await store.load_profiles(["code", "prose"])), profiles.failed_writes
        finally:
            await store.close()

    with RedisServer(persistent=True) as server:
        loaded, failures = asyncio.run(body(server))
    code = loaded["code"].domains["code"]
    assert (code.rounds, code.accepted, code.proposed) == (4.0, 6.0, 16.0)  # every round, once
    assert code.prior == 2.0  # the seeded prior survived the restart
    assert loaded["prose"].domains["code"].rounds == 1.0 and failures == 0
