"""Prometheus metrics of a running cluster: real processes, real Redis, real gRPC, /metrics over
HTTP. After a workload every service's families are there with values, and the speculative-decoding
counters add up."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from cosine_cli.cluster import ClusterSpec, LocalCluster
from cosine_cli.profiles import seed_profiles
from cosine_cli.status_metrics import format_figures, key_figures, scrape
from cosine_client import AsyncClient
from services.router.lookup import LOOKUP_ID

pytestmark = pytest.mark.slow


def total(samples, name, **labels) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == w for k, w in labels.items()))


def by_label(samples, name, label) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for lab, v in samples.get(name, []):
        out[lab[label]] += v
    return dict(out)


@pytest.fixture(scope="module")
def scraped(tiny_zoo, tmp_path_factory):
    spec = ClusterSpec(
        target=str(tiny_zoo.target.path),
        drafters={n: str(d.path) for n, d in tiny_zoo.drafters.items()},
        log_dir=str(tmp_path_factory.mktemp("metrics") / "logs"),
        cores=2,
    )
    with LocalCluster(spec) as cluster:
        asyncio.run(seed_profiles(cluster.redis_url, spec.prefix, tiny_zoo.acceptance, 20.0))
        prompts = [p for d in sorted(tiny_zoo.prompts) for p in tiny_zoo.prompts[d][:2]]

        async def work():
            async with AsyncClient(cluster.gateway_address, timeout=120) as client:
                await asyncio.gather(*(client.generate(p, max_new_tokens=12) for p in prompts))
                async for _ in client.stream(prompts[0], max_new_tokens=6):
                    pass

        asyncio.run(work())
        addresses = cluster.state()["metrics"]
        return {name: scrape(addr) for name, addr in addresses.items()}, len(prompts) + 1


def test_every_process_serves_metrics(scraped):
    per, _ = scraped
    assert {"gateway", "router", "verifier", "drafter-0"} <= set(per)
    for name, samples in per.items():
        # every service counts its RPCs through the interceptor
        assert total(samples, "grpc_server_handled_total") > 0, name


def test_gateway_latency_histograms(scraped):
    per, requests = scraped
    g = per["gateway"]
    assert total(g, "cosine_requests_total") == requests
    assert (
        total(g, "cosine_requests_total", outcome="length") + total(g, "cosine_requests_total", outcome="eos")
        == requests
    )
    for hist in ("cosine_time_to_first_token_seconds", "cosine_e2e_request_latency_seconds"):
        assert total(g, f"{hist}_count") == requests and total(g, f"{hist}_sum") > 0
    assert total(g, "cosine_time_per_output_token_seconds_count") > 0
    assert total(g, "cosine_generation_tokens_total") > 0 and total(g, "cosine_prompt_tokens_total") > 0
    assert (
        total(g, "grpc_server_handled_total", grpc_method="/cosine.v1.Gateway/Generate", grpc_code="OK") == requests - 1
    )


def test_speculative_counters_add_up(scraped):
    per, _ = scraped
    r = per["router"]
    drafted = total(r, "cosine_spec_draft_tokens_total")
    accepted = total(r, "cosine_spec_accepted_tokens_total")
    assert drafted > 0 and 0 <= accepted <= drafted
    # per drafter and per position, the parts sum to the totals
    assert sum(by_label(r, "cosine_spec_draft_tokens_total", "drafter").values()) == drafted
    assert sum(by_label(r, "cosine_spec_draft_tokens_by_position_total", "position").values()) == drafted
    assert sum(by_label(r, "cosine_spec_accepted_tokens_by_position_total", "position").values()) == accepted
    # the drafter label names a drafter model, or the router's own lookup drafter
    assert set(by_label(r, "cosine_spec_draft_tokens_total", "drafter")) <= per_drafters(per) | {LOOKUP_ID}
    rate = total(r, "cosine_spec_acceptance_rate")
    assert rate == pytest.approx(accepted / drafted)
    assert total(r, "cosine_router_rounds_total") > 0 and total(r, "cosine_router_batch_requests_count") > 0
    stages = by_label(r, "cosine_router_round_seconds_total", "stage")
    assert set(stages) == {"draft", "verify", "orchestration"} and stages["verify"] > 0
    assert total(r, "cosine_router_tokens_committed_total") == total(per["gateway"], "cosine_generation_tokens_total")


def per_drafters(per) -> set[str]:
    return {lab["model"] for lab, _ in per["drafter-0"].get("cosine_engine_requests", [])}


def test_kv_cache_gauges(scraped):
    per, _ = scraped
    v = per["verifier"]
    assert total(v, "cosine_verifier_batches_total") > 0 and total(v, "cosine_verifier_batch_seconds_count") > 0
    assert {lab["kind"] for lab, _ in v["cosine_kv_cache_tokens"]} == {"reserved", "budget"}
    assert total(v, "cosine_kv_cache_tokens", kind="budget") > 0
    assert len(per_drafters(per)) >= 2  # one series per hosted drafter
    graphs = {lab["kind"]: val for lab, val in v["cosine_cuda_graph_passes"]}
    assert set(graphs) == {"replayed", "captured", "eager"} and not any(graphs.values())  # none on a CPU


def test_status_key_figures_agree_with_the_counters(scraped):
    per, requests = scraped
    fig = key_figures(per)
    assert fig["requests_ended"] == requests and fig["requests_running"] == 0
    assert fig["tokens_generated"] == total(per["router"], "cosine_router_tokens_committed_total")
    assert 0 < fig["draft_tokens"] and 0 <= fig["accepted_tokens"] <= fig["draft_tokens"]
    assert fig["acceptance_rate"] == fig["accepted_tokens"] / fig["draft_tokens"]
    shares = [fig[f"round_share_{s}"] for s in ("draft", "verify", "orchestration")]
    assert all(0 <= s <= 1 for s in shares) and abs(sum(shares) - 1) < 1e-9
    assert fig["ttft_mean_s"] > 0 and fig["e2e_mean_s"] >= fig["ttft_mean_s"]
    lines = format_figures(fig)
    assert f"ended {requests}" in lines[0] and f"{fig['accepted_tokens']:.0f}/{fig['draft_tokens']:.0f}" in lines[2]
