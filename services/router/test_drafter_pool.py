"""The router's drafter pool: a failure mark expires while the drafter is still a member, and a
drafter that left between routing and drafting answers None instead of failing the batch."""

from __future__ import annotations

import asyncio

from common.platform.store import Member
from common.spec.types import DraftItem
from services.router.clients import DrafterEndpoint, GrpcDrafterPool


class FakeStore:
    def __init__(self, members):
        self.listed = members

    async def members(self, role):
        return list(self.listed)


class Closable:
    async def close(self):
        pass


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def pool_with(store, clock, connects):
    pool = GrpcDrafterPool(store, fingerprint="", retry_failed_s=10.0, clock=clock)

    async def connect(address, member_id):
        connects.append(address)
        ep = DrafterEndpoint(address, member_id, Closable(), Closable(), {"code": ["code"]})
        pool.endpoints[address] = ep

    pool._connect = connect
    return pool


def test_failure_mark_expires_while_the_member_lives():
    clock, connects = Clock(), []
    pool = pool_with(FakeStore([Member("drafter", "m1", "127.0.0.1:1")]), clock, connects)

    async def body():
        await pool.refresh()
        assert pool.live() == ["code"] and connects == ["127.0.0.1:1"]
        pool.mark_failed("code", "stream broke")
        assert pool.live() == []
        clock.now += 5
        await pool.refresh()  # too soon: still marked, no reconnect
        assert pool.live() == [] and len(connects) == 1
        clock.now += 6
        await pool.refresh()  # the mark expired and the membership is alive: reconnected, used again
        assert pool.live() == ["code"] and len(connects) == 2

    asyncio.run(body())


def test_a_drafter_gone_since_routing_answers_none():
    clock, connects = Clock(), []
    store = FakeStore([Member("drafter", "m1", "127.0.0.1:1")])
    pool = pool_with(store, clock, connects)

    async def body():
        await pool.refresh()
        store.listed = []
        await pool.refresh()  # scale-down: the process left the membership
        return await pool.draft_many({"code": [DraftItem("r1", append_ids=(1, 2), top_n=1)]})

    assert asyncio.run(body()) == {"code": None}
