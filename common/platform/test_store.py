import asyncio

import pytest

from common.platform.store import Member, Store, StoreUnavailable


def run(coro):
    return asyncio.run(coro)


def test_profiles_seed_then_online_updates(redis_url, redis_prefix):
    async def body():
        store = Store.from_url(redis_url, prefix=redis_prefix)
        await store.seed_profile("code", {"code": 3.0, "prose": 1.0}, prior_weight=10)
        await store.record_acceptance([("code", "code", 1.0, 4.0)] * 10 + [("prose-d", "prose", 2.0, 4.0)])
        profiles = await store.load_profiles(["code", "prose-d", "absent"])
        ids = await store.profile_ids()
        await store.close()
        return profiles, ids

    profiles, ids = run(body())
    code = profiles["code"]
    # (3.0 * 10 + 10 * 1.0) / (10 + 10) = 2.0: online evidence pulls the prior down
    assert code.score("code") == pytest.approx(2.0)
    assert code.score("prose") == pytest.approx(1.0)
    assert code.domains["code"].proposed == pytest.approx(40.0)
    assert profiles["prose-d"].score("prose") == pytest.approx(2.0)
    assert profiles["absent"].score("code") == 0.0
    assert ids == ["code", "prose-d"]


def test_request_state_lifecycle(redis_url, redis_prefix):
    async def body():
        store = Store.from_url(redis_url, prefix=redis_prefix, request_ttl_s=30)
        await store.create_request("r1", [1, 2, 3], {"max_new_tokens": 8}, owner="gw-1")
        await store.append_tokens("r1", [7, 8])
        await store.append_tokens("r1", [9], status="done")
        state = await store.get_request("r1")
        listed = await store.request_ids()
        await store.delete_request("r1")
        gone = await store.get_request("r1")
        left = await store.request_ids()
        await store.close()
        return state, listed, gone, left

    state, listed, gone, left = run(body())
    assert state["prompt_ids"] == [1, 2, 3]
    assert state["tokens"] == [7, 8, 9] and state["committed"] == 3
    assert state["status"] == "done" and state["params"] == {"max_new_tokens": 8}
    assert listed == ["r1"] and gone is None and left == []


def test_membership_expires_without_heartbeat(redis_url, redis_prefix):
    async def body():
        store = Store.from_url(redis_url, prefix=redis_prefix)
        await store.register(Member("drafter", "d1", "127.0.0.1:1", {"drafters": ["a"]}), ttl_s=0.3)
        await store.register(Member("drafter", "d2", "127.0.0.1:2"), ttl_s=30)
        first = [m.member_id for m in await store.members("drafter")]
        await asyncio.sleep(0.5)
        second = [m.member_id for m in await store.members("drafter")]
        await store.deregister("drafter", "d2")
        third = await store.members("drafter")
        await store.close()
        return first, second, third

    first, second, third = run(body())
    assert first == ["d1", "d2"]
    assert second == ["d2"]
    assert third == []


def test_unreachable_redis_is_reported():
    async def body():
        store = Store.from_url("redis://127.0.0.1:1/0")
        try:
            await store.ping()
        finally:
            await store.close()

    with pytest.raises(StoreUnavailable, match="111|refused"):
        run(body())


def test_duplicate_request_id_is_refused_and_touches_nothing(redis_url, redis_prefix):
    from common.platform.store import RequestExists

    async def body():
        store = Store.from_url(redis_url, prefix=redis_prefix, request_ttl_s=30)
        await store.create_request("d1", [1, 2], {"max_new_tokens": 8}, owner="gw-1")
        await store.append_tokens("d1", [5])
        with pytest.raises(RequestExists):
            await store.create_request("d1", [9, 9, 9], {"max_new_tokens": 1}, owner="gw-2")
        state = await store.get_request("d1")
        await store.delete_request("d1")
        await store.create_request("d1", [3], {}, owner="gw-2")  # free again once the first is gone
        again = await store.get_request("d1")
        await store.delete_request("d1")
        await store.close()
        return state, again

    state, again = run(body())
    assert state["prompt_ids"] == [1, 2] and state["tokens"] == [5] and state["owner"] == "gw-1"
    assert again["prompt_ids"] == [3] and again["owner"] == "gw-2"


def test_a_burst_of_requests_waits_for_pooled_connections(redis_url, redis_prefix):
    """Three times as many requests created at once as the pool has connections, each while every
    connection is held (a blocking read of 50 ms per connection): they wait for a free connection
    instead of failing with "Too many connections"."""
    from common.platform.store import POOL_CONNECTIONS

    async def body():
        store = Store.from_url(redis_url, prefix=redis_prefix, request_ttl_s=30)
        holders = [store._r.blpop([f"{redis_prefix}nothing"], timeout=0.05) for _ in range(POOL_CONNECTIONS)]
        creates = [store.create_request(f"burst-{i}", [1], {}, owner="gw-1") for i in range(3 * POOL_CONNECTIONS)]
        out = await asyncio.gather(*holders, *creates, return_exceptions=True)
        ids = await store.request_ids()
        for i in range(3 * POOL_CONNECTIONS):
            await store.delete_request(f"burst-{i}")
        await store.close()
        return [o for o in out if isinstance(o, BaseException)], ids

    errors, ids = run(body())
    assert errors == []
    assert len(ids) == 3 * POOL_CONNECTIONS


def test_lexicon_seed_and_learned_prompts_add_up(redis_url, redis_prefix):
    async def body():
        store = Store.from_url(redis_url, prefix=redis_prefix)
        try:
            await store.seed_lexicon({"code": (2, {7: 3, 8: 1}), "prose": (1, {9: 4})})
            await store.seed_lexicon(
                {"code": (2, {7: 3, 8: 1}), "prose": (1, {9: 4})}
            )  # seeding again replaces, never adds
            await store.add_to_lexicon("code", [7, 7, 10])
            await store.add_to_lexicon("chat", [11])
            both = await store.load_lexicon()
            again, seeded = await store.load_lexicon_and_seeds()  # chat was only learned, never seeded
            assert again == both
            await store.seed_lexicon({"code": (1, {12: 1})})  # a new seed drops the old one, keeps what routers learned
            reseeded = await store.load_lexicon()
            await store.seed_lexicon({"code": (1, {12: 1})}, reset=True)  # reset: the learned counts go too
            reset = await store.load_lexicon()
        finally:
            await store.close()
        return both, seeded, reseeded, reset

    both, seeded, reseeded, reset = run(body())
    assert seeded == {"code", "prose"}
    assert both == {"code": (3, {7: 5, 8: 1, 10: 1}), "prose": (1, {9: 4}), "chat": (1, {11: 1})}
    assert reseeded == {"code": (2, {12: 1, 7: 2, 10: 1}), "chat": (1, {11: 1})}
    assert reset == {"code": (1, {12: 1})}


def test_the_lookup_corpus_is_replaced_whole_and_read_back_as_written(redis_url, redis_prefix):
    async def body():
        store = Store.from_url(redis_url, prefix=redis_prefix)
        try:
            empty, v0 = await store.load_corpus(), await store.corpus_version()
            await store.seed_corpus({"code": [[1, 2, 3], [4, 5]], "prose": [[6, 7, 8, 9]]})
            first, v1 = await store.load_corpus(), await store.corpus_version()
            await store.seed_corpus({"code": [[10, 11]]})  # a new seed replaces every domain's sequences
            second, v2 = await store.load_corpus(), await store.corpus_version()
            wrote = await store.seed_corpus({"code": [[10, 11]]})  # the same corpus again: nothing moves
            same, v3 = await store.load_corpus(), await store.corpus_version()
            await store.seed_corpus({"code": [[10, 12]]})  # one token differs: a new seed
            third, v4 = await store.load_corpus(), await store.corpus_version()
        finally:
            await store.close()
        assert v0 == 0 and v1 == 1 and v2 == 2  # routers reload when the version moves
        assert wrote is False and same == second and v3 == 2
        assert third == {"code": [[10, 12]]} and v4 == 3
        return empty, first, second

    empty, first, second = run(body())
    assert empty == {}
    assert first == {"code": [[1, 2, 3], [4, 5]], "prose": [[6, 7, 8, 9]]}
    assert second == {"code": [[10, 11]]}
