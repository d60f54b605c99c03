"""Planned and unplanned absences with real processes, real Redis and real gRPC:

- a drafter replica sent SIGTERM drains (NOT_SERVING, out of the membership at once, in-flight
  steps answered) and exits cleanly; the router moves its requests to the other replica; no
  request fails and greedy output equals the target's;
- Redis killed under load and started again on the same port: running requests complete with
  the target's greedy output, a request arriving while Redis is down gets UNAVAILABLE, one
  arriving after is served, profiles survive and no request state is left behind.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

from common.platform.store import Store
from cosine_cli.cluster import LocalCluster
from cosine_cli.profiles import seed_profiles
from cosine_client import AsyncClient, Unavailable
from tests.test_cluster import MAX_NEW, greedy_reference, spec_for, workload  # noqa: F401  (fixtures)
from tests.test_replicas_cluster import router_drafters, start_drafter_replica

pytestmark = pytest.mark.slow

# Long enough that requests are still running when the absence begins: with the lookup drafter the
# tiny zoo's repetitive output takes only a few rounds per request.
LONG = MAX_NEW * 4


@pytest.fixture(scope="module")
def long_reference(tiny_zoo, workload):  # noqa: F811
    return greedy_reference(tiny_zoo, [p for _, p in workload], LONG)


async def under_load(client: AsyncClient, work, absence) -> tuple[int, list[list[int]]]:
    """Stream every prompt of ``work`` at once; once every stream has its first tokens (all
    admitted, none waiting for Redis) call ``absence()``. Returns how many streams were still
    running at that moment and each stream's token ids, in ``work`` order."""
    first = [asyncio.Event() for _ in work]

    async def one(i: int, prompt: str) -> list[int]:
        ids: list[int] = []
        try:
            async for chunk in client.stream(prompt, max_new_tokens=LONG):
                ids.extend(chunk.token_ids)
                first[i].set()
        finally:
            first[i].set()
        return ids

    tasks = [asyncio.create_task(one(i, p)) for i, (_, p) in enumerate(work)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first)), 120)
    running = sum(not t.done() for t in tasks)
    await absence()
    return running, await asyncio.gather(*tasks)


def store_call(cluster: LocalCluster, fn):
    async def body():
        store = Store.from_url(cluster.redis_url, prefix=cluster.spec.prefix)
        try:
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(body())


def test_sigterm_drains_a_drafter_replica_without_failing_a_request(tiny_zoo, tmp_path, workload, long_reference):  # noqa: F811
    c = LocalCluster(spec_for(tiny_zoo, tmp_path))
    c.start(progress=False)
    try:
        start_drafter_replica(c)
        work = workload * 4
        victim = c.proc("drafter-0")

        async def drain():
            c.signal("drafter-0", signal.SIGTERM)

        async def body():
            async with AsyncClient(c.gateway_address, timeout=180) as client:
                return await under_load(client, work, drain)

        running, results = asyncio.run(body())
        assert running > 0  # the drain happened under load
        for (_, prompt), ids in zip(work, results):
            assert ids == long_reference[prompt]
        assert victim.popen.wait(30) == 0  # drained and exited by itself, not killed
        members = store_call(c, lambda s: s.members("drafter"))
        assert [m.member_id for m in members] == ["drafter-replica"]
        events = [
            json.loads(line).get("event") for line in victim.log_path.read_text().splitlines() if line.startswith("{")
        ]
        assert "draining" in events and "drained" in events
        health = router_drafters(c.router_address)  # every drafter still served, by the replica
        assert set(health) >= set(tiny_zoo.drafters) and all(health[d] for d in tiny_zoo.drafters)
    finally:
        c.stop()


def test_redis_restart_under_load(tiny_zoo, tmp_path, workload, long_reference):  # noqa: F811
    c = LocalCluster(spec_for(tiny_zoo, tmp_path))
    c.start(progress=False)
    try:
        asyncio.run(seed_profiles(c.redis_url, c.spec.prefix, tiny_zoo.acceptance, 20.0))
        before = store_call(c, lambda s: s.load_profiles(sorted(tiny_zoo.drafters)))
        work = workload * 4

        async def body():
            async with AsyncClient(c.gateway_address, timeout=180) as client:

                async def outage():
                    c.kill("redis")
                    with pytest.raises(Unavailable):  # a new request cannot be admitted
                        await client.generate(work[0][1], max_new_tokens=LONG)
                    await asyncio.sleep(1.0)
                    c.respawn("redis")  # same port, same append-only file

                running, results = await under_load(client, work, outage)
                after = await client.generate(work[0][1], max_new_tokens=LONG)
                return running, results, after

        running, results, after = asyncio.run(body())
        assert running > 0  # requests were in flight while Redis was down
        for (_, prompt), ids in zip(work, results):
            assert ids == long_reference[prompt]
        assert list(after.token_ids) == long_reference[work[0][1]]
        profiles = store_call(c, lambda s: s.load_profiles(sorted(tiny_zoo.drafters)))
        for d in tiny_zoo.drafters:  # the seeded priors survived the restart
            for domain, stats in before[d].domains.items():
                assert profiles[d].domains[domain].prior == pytest.approx(stats.prior)
        deadline = time.monotonic() + 20  # deferred deletes go out with the gateway's next writes
        while store_call(c, lambda s: s.request_ids()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert store_call(c, lambda s: s.request_ids()) == []
    finally:
        c.stop()
