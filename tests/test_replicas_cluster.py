"""Drafter replicas with real processes: a second process hosting the same drafters joins the
router's pool; when the first is killed under load, the replica serves on, no request fails and
greedy output equals the target's."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from cosine.v1 import router_pb2, router_pb2_grpc
from cosine_cli.cluster import LocalCluster, free_port
from tests.test_cluster import generate_while_killing, reference, spec_for, workload  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow


def router_drafters(address: str) -> dict[str, bool]:
    async def body():
        async with grpc.aio.insecure_channel(address) as ch:
            st = await router_pb2_grpc.RouterStub(ch).Status(router_pb2.StatusRequest(), timeout=10)
            return {d.drafter_id: d.healthy for d in st.drafters}

    return asyncio.run(body())


def start_drafter_replica(c: LocalCluster) -> None:
    """A second drafter process hosting every drafter of the cluster, connected by the router."""
    args = [a for name, path in c.spec.drafters.items() for a in ("--drafters", f"{name}={path}")]
    replica = c._spawn("drafter-replica", "services.drafter", free_port(c.spec.host), args, 1)
    asyncio.run(c._wait([replica], "replica"))
    time.sleep(3)  # a discovery interval or more: the router connects the replica


def test_replica_takes_over_when_a_drafter_process_dies(tiny_zoo, tmp_path, workload, reference):  # noqa: F811
    c = LocalCluster(spec_for(tiny_zoo, tmp_path))
    c.start(progress=False)
    try:
        start_drafter_replica(c)

        results = generate_while_killing(c, workload, "drafter-0")
        for (_, prompt), res in zip(workload, results):
            assert list(res.token_ids) == reference[prompt]
        # every drafter is still served, by the replica
        health = router_drafters(c.router_address)
        assert set(health) >= set(tiny_zoo.drafters) and all(health[d] for d in tiny_zoo.drafters)
    finally:
        c.stop()
