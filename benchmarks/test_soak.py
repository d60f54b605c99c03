"""The soak benchmark's counting: every stream is completed or lost, never both, never neither;
latency figures come from the completed ones only. Real cluster, real streams (small N)."""

from __future__ import annotations

import asyncio
import json

import pytest

from benchmarks.soak import StreamOutcome, main, percentile, run_streams, summarize
from cosine_cli.cluster import ClusterSpec, LocalCluster


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile(values, 100) == 100.0
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None


def test_summary_counts_lost_streams_apart():
    outcomes = [
        StreamOutcome(True, 4, 1.0, 0.1),
        StreamOutcome(True, 4, 3.0, 0.3),
        StreamOutcome(False, 2, error="UNAVAILABLE"),
        StreamOutcome(False, 0),
    ]
    s = summarize(outcomes, wall_s=2.0)
    assert (s["streams"], s["completed"], s["lost"]) == (4, 2, 2)
    assert s["lost_by_reason"] == {"UNAVAILABLE": 1, "ended": 1}
    assert s["tokens"] == 8 and s["tokens_per_s"] == 4.0  # tokens of completed streams only
    assert s["latency_p50_s"] == 1.0 and s["latency_p99_s"] == 3.0 and s["ttft_p99_s"] == 0.3


@pytest.mark.slow
def test_small_soak_counts_completed_and_lost_streams(tiny_zoo, tmp_path, capsys):
    cluster = LocalCluster(
        ClusterSpec(
            target=str(tiny_zoo.target.path),
            drafters={n: str(d.path) for n, d in tiny_zoo.drafters.items()},
            log_dir=str(tmp_path / "logs"),
            cores=2,
        )
    )
    address = cluster.start(progress=False)
    try:
        prompts = [p for d in sorted(tiny_zoo.prompts) for p in tiny_zoo.prompts[d]]
        ok, _ = asyncio.run(run_streams(address, prompts, 12, 6, timeout_s=120))
        late, _ = asyncio.run(run_streams(address, prompts, 3, 400, timeout_s=0.05))  # deadline far too short
        s = summarize(ok + late, wall_s=1.0)
        assert (s["streams"], s["completed"], s["lost"]) == (15, 12, 3)
        assert s["lost_by_reason"] == {"DEADLINE_EXCEEDED": 3}
        assert all(o.tokens <= 6 and o.ttft_s is not None and o.ttft_s <= o.latency_s for o in ok)

        code = main(
            ["--address", address, "--zoo", str(tiny_zoo.root), "--streams", "8", "--max-new-tokens", "4", "--json"]
        )
        report = json.loads(capsys.readouterr().out)
        assert code == 0 and (report["streams"], report["completed"], report["lost"]) == (8, 8, 0)
        assert report["latency_p99_s"] >= report["latency_p50_s"] > 0
    finally:
        cluster.stop()
