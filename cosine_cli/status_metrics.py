"""The key figures of a running cluster, read from each service's Prometheus ``/metrics`` (what
``cosine status`` prints under the router's own view)."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(address: str, timeout_s: float = 5.0) -> Samples:
    """Every sample of ``http://address/metrics`` by sample name: [(labels, value)]."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode()
    out: Samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name].append((dict(sample.labels), sample.value))
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == w for k, w in labels.items()))


def scrape_all(addresses: Mapping[str, str], timeout_s: float = 5.0) -> tuple[dict[str, Samples], dict[str, str]]:
    """(samples by process, error by process that could not be scraped)."""
    got: dict[str, Samples] = {}
    errors: dict[str, str] = {}
    for name, address in sorted(addresses.items()):
        try:
            got[name] = scrape(address, timeout_s)
        except (OSError, urllib.error.URLError, ValueError) as exc:
            errors[name] = str(getattr(exc, "reason", exc))
    return got, errors


def _mean(samples: Samples, histogram: str) -> float | None:
    count = total(samples, f"{histogram}_count")
    return total(samples, f"{histogram}_sum") / count if count else None


def key_figures(per: Mapping[str, Samples]) -> dict[str, float | None]:
    """Requests, latency means, speculative-decoding totals and the round split, summed over the
    processes of each role (process names are role or role-N)."""

    def role(name: str) -> str:
        return name.split("-")[0]

    gateway: Samples = defaultdict(list)
    router: Samples = defaultdict(list)
    for name, samples in per.items():
        target = gateway if role(name) == "gateway" else router if role(name) == "router" else None
        if target is not None:
            for key, values in samples.items():
                target[key].extend(values)
    drafted = total(router, "cosine_spec_draft_tokens_total")
    accepted = total(router, "cosine_spec_accepted_tokens_total")
    rounds = total(router, "cosine_router_rounds_total")
    stages = {
        s: total(router, "cosine_router_round_seconds_total", stage=s) for s in ("draft", "verify", "orchestration")
    }
    round_time = sum(stages.values())
    kv = [
        v
        for name, s in per.items()
        if role(name) in ("verifier", "drafter")
        for _, v in s.get("cosine_kv_cache_usage_ratio", [])
    ]
    figures: dict[str, float | None] = {
        "requests_ended": total(gateway, "cosine_requests_total"),
        "requests_running": total(gateway, "cosine_requests_running"),
        "tokens_generated": total(gateway, "cosine_generation_tokens_total"),
        "ttft_mean_s": _mean(gateway, "cosine_time_to_first_token_seconds"),
        "tpot_mean_s": _mean(gateway, "cosine_time_per_output_token_seconds"),
        "e2e_mean_s": _mean(gateway, "cosine_e2e_request_latency_seconds"),
        "queue_depth": total(router, "cosine_router_queue_depth"),
        "rounds": rounds,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "accepted_per_round": accepted / rounds if rounds else None,
        "verifier_busy_fraction": total(router, "cosine_router_verifier_busy_fraction") if router else None,
        "kv_cache_usage_max": max(kv) if kv else None,
    }
    for stage, seconds in stages.items():
        figures[f"round_share_{stage}"] = seconds / round_time if round_time else None
    return figures


def format_figures(figures: Mapping[str, float | None]) -> list[str]:
    def f(key: str, fmt: str, scale: float = 1.0) -> str:
        value = figures.get(key)
        return "-" if value is None else format(value * scale, fmt)

    return [
        f"requests  ended {f('requests_ended', '.0f')}, running {f('requests_running', '.0f')}, queued "
        f"{f('queue_depth', '.0f')}; "
        f"tokens generated {f('tokens_generated', '.0f')}",
        f"latency   time to first token {f('ttft_mean_s', '.1f', 1e3)} ms, per output token "
        f"{f('tpot_mean_s', '.1f', 1e3)} ms, "
        f"end to end {f('e2e_mean_s', '.2f')} s (means)",
        f"speculate {f('rounds', '.0f')} rounds, {f('accepted_tokens', '.0f')}/{f('draft_tokens', '.0f')} draft "
        "tokens accepted "
        f"({f('acceptance_rate', '.0%')}), {f('accepted_per_round', '.2f')} accepted per round",
        f"rounds    draft {f('round_share_draft', '.0%')}, verify {f('round_share_verify', '.0%')}, "
        f"orchestration {f('round_share_orchestration', '.0%')} of round time; verifier busy "
        f"{f('verifier_busy_fraction', '.0%')} "
        f"(last round); KV cache use up to {f('kv_cache_usage_max', '.0%')}",
    ]
