"""The gateway's Prometheus families: what a client sees of every request (no gRPC here).

- ``cosine_requests_total{outcome}``: requests ended, by finish reason (length, eos, stop) or
  failure status;
- ``cosine_time_to_first_token_seconds``, ``cosine_time_per_output_token_seconds``,
  ``cosine_e2e_request_latency_seconds``: histograms, from admission at the gateway;
- ``cosine_prompt_tokens_total``, ``cosine_generation_tokens_total``;
- ``cosine_requests_running``: requests between admission and their end;
- ``cosine_spec_decode_rounds_total``, ``cosine_spec_decode_draft_tokens_total``,
  ``cosine_spec_decode_accepted_tokens_total``, ``cosine_spec_decode_accepted_tokens_by_drafter_total{drafter}``:
  the speculation figures of the requests that ended, as the router reported them with each
  request's last chunk (the router's own ``cosine_spec_*`` families count round by round).

All of them are served on the metrics port and on the HTTP API's ``/metrics``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from common.platform.metrics import ServiceMetrics
from services.gateway.progress import SpecStats

TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class GatewayMetrics:
    def __init__(self, metrics: ServiceMetrics) -> None:
        m = metrics
        self.requests = m.counter(
            "cosine_requests_total", "requests ended, by finish reason or failure status", ["outcome"]
        )
        self.ttft = m.histogram("cosine_time_to_first_token_seconds", "admission to the first generated token")
        self.tpot = m.histogram(
            "cosine_time_per_output_token_seconds", "time per output token after the first", buckets=TPOT_BUCKETS
        )
        self.e2e = m.histogram("cosine_e2e_request_latency_seconds", "admission to the end of the request")
        self.prompt_tokens = m.counter("cosine_prompt_tokens_total", "prompt tokens admitted")
        self.generation_tokens = m.counter("cosine_generation_tokens_total", "tokens generated")
        self.running = m.gauge("cosine_requests_running", "requests between admission and their end")
        self.spec_rounds = m.counter("cosine_spec_decode_rounds_total", "rounds of the requests that ended")
        self.spec_draft = m.counter(
            "cosine_spec_decode_draft_tokens_total", "draft tokens verified for the requests that ended"
        )
        self.spec_accepted = m.counter(
            "cosine_spec_decode_accepted_tokens_total", "draft tokens accepted for the requests that ended"
        )
        self.spec_by_drafter = m.counter(
            "cosine_spec_decode_accepted_tokens_by_drafter_total",
            "accepted draft tokens that were the drafter's own first choice, for the requests that ended",
            ["drafter"],
        )
        self.spec_grammar_pruned = m.counter(
            "cosine_spec_decode_grammar_pruned_tokens_total",
            "draft tokens the requests' constraints forbade, pruned before verification, for the requests that ended",
        )

    def start(self, prompt_tokens: int) -> RequestClock:
        self.prompt_tokens.inc(prompt_tokens)
        self.running.inc()
        return RequestClock(self)


@dataclass
class RequestClock:
    """One request's timeline; :meth:`end` records it exactly once."""

    metrics: GatewayMetrics
    started: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    tokens: int = 0
    stats: SpecStats | None = None  # the router's figures, from the request's last chunk
    ended: bool = False

    def tokens_out(self, n: int) -> None:
        if n and self.first_token is None:
            self.first_token = time.perf_counter()
            self.metrics.ttft.observe(self.first_token - self.started)
        self.tokens += n

    def end(self, outcome: str) -> None:
        if self.ended:
            return
        self.ended = True
        m = self.metrics
        now = time.perf_counter()
        m.running.dec()
        m.requests.labels(outcome).inc()
        m.generation_tokens.inc(self.tokens)
        m.e2e.observe(now - self.started)
        if self.first_token is not None and self.tokens > 1:
            m.tpot.observe((now - self.first_token) / (self.tokens - 1))
        if self.stats is not None:
            m.spec_rounds.inc(self.stats.rounds)
            m.spec_draft.inc(self.stats.draft_tokens)
            m.spec_accepted.inc(self.stats.accepted_tokens)
            for drafter, n in self.stats.accepted_by_drafter.items():
                m.spec_by_drafter.labels(drafter).inc(n)
            m.spec_grammar_pruned.inc(self.stats.grammar_pruned_tokens)
