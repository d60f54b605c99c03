"""Replica choice: stable per request, spread over replicas, minimal moves when one leaves."""

from __future__ import annotations

from collections import Counter

from services.router.replicas import pick_replica


def test_pick_replica_is_stable_and_spreads_load():
    replicas = ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"]
    ids = [f"req-{i}" for i in range(600)]
    first = {rid: pick_replica(rid, replicas) for rid in ids}
    assert first == {rid: pick_replica(rid, list(reversed(replicas))) for rid in ids}
    counts = Counter(first.values())
    assert set(counts) == set(replicas)
    assert min(counts.values()) > 600 / 3 / 2  # no replica starves


def test_a_leaving_replica_moves_only_its_requests():
    replicas = ["a:1", "b:1", "c:1"]
    ids = [f"r{i}" for i in range(300)]
    before = {rid: pick_replica(rid, replicas) for rid in ids}
    after = {rid: pick_replica(rid, ["a:1", "c:1"]) for rid in ids}
    moved = {rid for rid in ids if before[rid] != after[rid]}
    assert moved == {rid for rid in ids if before[rid] == "b:1"}
    assert pick_replica("x", []) is None
