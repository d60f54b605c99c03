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

from common.store import Store
from cosine_cli.cluster import LocalCluster
from cosine_cli.commands import seed_profiles
from cosine_client import AsyncClient, Unavailable
from tests.test_cluster import MAX_NEW, reference, spec_for, workload  # noqa: F401  (fixtures)
from tests.test_replicas_cluster import router_drafters, start_drafter_replica

pytestmark = pytest.mark.slow


def store_call(cluster: LocalCluster, fn):
    async def body():
        store = Store.from_url(cluster.redis_url, prefix=cluster.spec.prefix)
        try:
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(body())


def test_sigterm_drains_a_drafter_replica_without_failing_a_request(tiny_zoo, tmp_path, workload, reference):  # noqa: F811
    c = LocalCluster(spec_for(tiny_zoo, tmp_path))
    c.start(progress=False)
    try:
        start_drafter_replica(c)
        work = workload * 4
        victim = c.proc("drafter-0")

        async def body():
            async with AsyncClient(c.gateway_address, timeout=180) as client:
                tasks = [asyncio.create_task(client.generate(p, max_new_tokens=MAX_NEW)) for _, p in work]
                await asyncio.sleep(0.5)
                running = sum(not t.done() for t in tasks)
                c.signal("drafter-0", signal.SIGTERM)
                return running, await asyncio.gather(*tasks)

        running, results = asyncio.run(body())
        assert running > 0  # the drain happened under load
        for (_, prompt), res in zip(work, results):
            assert list(res.token_ids) == reference[prompt]
        assert victim.popen.wait(30) == 0  # drained and exited by itself, not killed
        members = store_call(c, lambda s: s.members("drafter"))
        assert [m.member_id for m in members] == ["drafter-replica"]
        events = [json.loads(line).get("event") for line in victim.log_path.read_text().splitlines() if line.startswith("{")]
        assert "draining" in events and "drained" in events
        health = router_drafters(c.router_address)  # every drafter still served, by the replica
        assert set(health) >= set(tiny_zoo.drafters) and all(health[d] for d in tiny_zoo.drafters)
    finally:
        c.stop()


def test_redis_restart_under_load(tiny_zoo, tmp_path, workload, reference):  # noqa: F811
    c = LocalCluster(spec_for(tiny_zoo, tmp_path))
    c.start(progress=False)
    try:
        asyncio.run(seed_profiles(c.redis_url, c.spec.prefix, tiny_zoo.acceptance, 20.0))
        before = store_call(c, lambda s: s.load_profiles(sorted(tiny_zoo.drafters)))
        work = workload * 4

        async def body():
            async with AsyncClient(c.gateway_address, timeout=180) as client:
                tasks = [asyncio.create_task(client.generate(p, max_new_tokens=MAX_NEW)) for _, p in work]
                await asyncio.sleep(0.5)
                c.kill("redis")
                running = sum(not t.done() for t in tasks)
                with pytest.raises(Unavailable):
                    await client.generate(work[0][1], max_new_tokens=MAX_NEW)
                await asyncio.sleep(1.0)
                c.respawn("redis")  # same port, same append-only file
                results = await asyncio.gather(*tasks)
                after = await client.generate(work[0][1], max_new_tokens=MAX_NEW)
                return running, results, after

        running, results, after = asyncio.run(body())
        assert running > 0  # requests were in flight while Redis was down
        for (_, prompt), res in zip(work, results):
            assert list(res.token_ids) == reference[prompt]
        assert list(after.token_ids) == reference[work[0][1]]
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
