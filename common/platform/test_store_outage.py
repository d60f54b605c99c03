"""The Store across a real Redis outage: a redis-server with its append-only file is killed and
started again on the same port. Running requests' writes wait and land exactly once; new
requests are refused while nothing can be written; profiles survive."""

from __future__ import annotations

import asyncio

import pytest

from common.platform.store import Store, StoreUnavailable
from cosine_cli.redis_server import RedisServer


def test_writes_survive_a_redis_restart_and_land_once():
    async def body(server: RedisServer):
        store = Store.from_url(server.url, prefix="outage", request_ttl_s=60)
        try:
            await store.seed_profile("code", {"code": 2.5}, prior_weight=10)
            await store.create_request("r1", [1, 2], {"max_new_tokens": 8}, owner="gw")
            assert await store.append_tokens("r1", [7, 8]) is True

            server.kill()
            assert await store.append_tokens("r1", [9]) is False  # kept, not raised
            assert await store.append_tokens("r1", [10]) is False
            with pytest.raises(StoreUnavailable):
                await store.create_request("r2", [3], {}, owner="gw")
            with pytest.raises(StoreUnavailable):
                await store.load_profiles(["code"])
            assert await store.delete_request("r0") is False  # remembered
            assert store.backlog() == {"requests": 1, "tokens": 2, "deletes": 1}

            server.start()
            assert await store.append_tokens("r1", [11], status="done") is True
            state = await store.get_request("r1")
            profiles = await store.load_profiles(["code"])
            await store.create_request("r2", [3], {}, owner="gw")  # accepted again
            backlog = store.backlog()
            await store.delete_request("r1")
            await store.delete_request("r2")
            left = await store.request_ids()
            return state, profiles, backlog, left
        finally:
            await store.close()

    with RedisServer(persistent=True) as server:
        state, profiles, backlog, left = asyncio.run(body(server))
    assert state["tokens"] == [7, 8, 9, 10, 11] and state["committed"] == 5 and state["status"] == "done"
    assert state["prompt_ids"] == [1, 2]
    assert profiles["code"].score("code") == pytest.approx(2.5)
    assert backlog == {"requests": 0, "tokens": 0, "deletes": 0}
    assert left == []


def test_a_retried_append_is_not_doubled(redis_url, redis_prefix):
    """Two writers' view of the same offset (a write whose reply was lost, then retried): the
    tokens already in Redis are skipped."""

    async def body():
        a = Store.from_url(redis_url, prefix=redis_prefix)
        try:
            await a.create_request("r", [1], {}, owner="gw")
            assert await a.append_tokens("r", [5, 6])
            a._written["r"], a._unwritten["r"] = 0, [5, 6]  # as if the reply of that write had been lost
            assert await a.append_tokens("r", [7])  # re-sends 5, 6, 7 from offset 0
            return await a.get_request("r")
        finally:
            await a.delete_request("r")
            await a.close()

    state = asyncio.run(body())
    assert state["tokens"] == [5, 6, 7] and state["committed"] == 3


def test_state_lost_by_redis_is_not_rewritten_partially(redis_url, redis_prefix):
    async def body():
        store = Store.from_url(redis_url, prefix=redis_prefix)
        try:
            await store.create_request("r", [1], {}, owner="gw")
            await store._r.delete(store.request_key("r"))  # as a Redis without persistence after a restart
            ok = await store.append_tokens("r", [5])
            return ok, await store.get_request("r")
        finally:
            await store.close()

    ok, state = asyncio.run(body())
    assert ok is False and state is None


def test_redis_lost_between_an_append_and_its_deferred_deletes(redis_url, redis_prefix, monkeypatch):
    """The append lands, then Redis goes before the deletes held back by an outage go out: the
    append still reports success and never raises (a running request must not fail), and the
    deletes wait for the next write."""

    async def body():
        store = Store.from_url(redis_url, prefix=redis_prefix)
        try:
            await store.create_request("r", [1], {}, owner="gw")
            await store.create_request("gone", [2], {}, owner="gw")
            real_delete = store._r.delete

            async def refused(*keys):
                raise ConnectionError("Error 111 connecting: Connection refused")

            monkeypatch.setattr(store._r, "delete", refused)
            assert await store.delete_request("gone") is False  # remembered
            ok = await store.append_tokens("r", [5])  # lands; its flush of the deletes is refused
            pending = store.backlog()["deletes"]
            monkeypatch.setattr(store._r, "delete", real_delete)
            assert await store.append_tokens("r", [6])  # Redis answers deletes again: they go out
            return ok, pending, await store.get_request("r"), await store.get_request("gone"), store.backlog()
        finally:
            await store.delete_request("r")
            await store.close()

    ok, pending, state, gone, backlog = asyncio.run(body())
    assert ok is True and pending == 1
    assert state["tokens"] == [5, 6]
    assert gone is None and backlog["deletes"] == 0
