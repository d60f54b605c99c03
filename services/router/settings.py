"""Settings of the router service (flags or COSINE_* variables; see `python -m services.router --help`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.platform.service import ServiceSettings
from common.platform.settings import in_range, non_negative, port_check, positive, setting


def check_verify_chunks(value: str) -> str | None:
    """``--verify-chunks``: ``auto``, ``off`` or a chunk depth of at least 1 (``frontiers.chunk_depth``)."""
    if value in ("off", "auto") or (value.isdigit() and int(value) >= 1):
        return None
    return "must be auto, off or a chunk depth (a whole number of at least 1)"


@dataclass(frozen=True)
class RouterSettings(ServiceSettings):
    port: int = setting(50052, help="port to listen on (0 picks a free port)", check=port_check)
    metrics_port: int = setting(
        9101,
        help="port of the Prometheus /metrics endpoint (0: any free port, -1: off)",
        check=lambda v: None if -1 <= v <= 65535 else "must be -1 (off), 0 (any free port) or a port",
    )
    verifier_address: str = setting("", help="host:port of the verifier (default: discovered through Redis membership)")
    discovery_interval_s: float = setting(
        1.0, help="how often live drafters are re-read from Redis, seconds", check=positive
    )
    # speculation
    min_k: int = setting(1, help="shortest speculation length (draft depth) per round", check=positive)
    max_k: int = setting(8, help="longest speculation length per round", check=positive)
    initial_k: int = setting(4, help="speculation length of a request's first round", check=positive)
    tree_width: int = setting(
        3, help="most sibling candidates per tree level (losing fusion candidates become siblings)", check=positive
    )
    drafters_per_request: int = setting(2, help="drafters that cooperate on one request", check=positive)
    fusion: str = setting(
        "chunk",
        help="chunk: each drafter drafts a whole chunk in one call, the chunks fused into one tree; token: fuse "
        "drafter proposals at every draft step (k steps a round)",
        choices=("chunk", "token"),
    )
    local_fusion: bool = setting(
        True,
        help="with token fusion, a drafter process that hosts every drafter of a request fuses the "
        "request's whole round itself and answers once (off: one message per draft step)",
    )
    routing: bool = setting(
        True, help="route by expertise (off: every request uses the first drafters in a fixed order)"
    )
    use_drafters: tuple[str, ...] = setting(
        (),
        help="only these drafter ids serve requests (repeatable or comma-separated; default: every live drafter)",
        metavar="DRAFTER_ID",
    )
    all_drafters: bool = setting(
        False, help="every live drafter drafts every request (SpecInfer-style trees; overrides routing)"
    )
    adaptive_k: bool = setting(
        True, help="adapt each request's speculation length to its acceptance and the verifier's load"
    )
    domain_detection: str = setting(
        "lexicon",
        choices=("lexicon", "drafters"),
        help="how a new request's domain is found: lexicon (a token lexicon; seeded from the zoo's labelled prompts "
        "it decides "
        "wherever it is confident, unseeded it learns from drafter scores and stands in once it agrees with "
        "them; no drafter pass) or drafters (every live drafter scores every new prompt)",
    )
    shared_lexicon: bool = setting(
        True,
        help="start the domain lexicon from the one in Redis (the zoo's seed, written by `cosine up`, plus "
        "what routers learned) and add to it the prompts this router's drafters score; off: "
        "this router learns its own from nothing",
    )
    speculate: bool = setting(
        True, help="draft at all (off: plain decoding of the target through the same verifier, for baselines)"
    )
    cost_control: bool = setting(
        True,
        help="verify and draft only the nodes whose expected tokens repay their verifier and drafter time (measured "
        "online); off: every drafted node is verified",
    )
    draft_pricing: bool = setting(
        True,
        help="with cost control, a request drafts in a round only when its first node's expected "
        "tokens also repay its share of the drafters' time (measured online); off: only its verify row is priced",
    )
    domain_gate: bool = setting(
        True,
        help="with cost control, keep the record of whether drafting pays per domain (a new request's starting "
        "point and the probe interval; its domain guessed by the lexicon at submission, no drafter pass); "
        "off: one record for every request",
    )
    probe_share: float = setting(
        0.03,
        help="with cost control, the most of the router's time that probing may take: a request turned down "
        "to plain decoding drafts now and then to see whether drafting pays again, and its drafters' "
        "catch-up is charged against this share (1.0: in effect, probes as often as their round intervals allow)",
        check=in_range(0.001, 1.0),
    )
    yield_guard: bool = setting(
        True,
        help="with cost control, measure what speculation commits per second against plain decoding, per load "
        "level (epochs of either arm, the losing one now and then as a control group), and withdraw speculation "
        "wherever it yields less; re-admit it when it yields more again",
    )
    yield_epoch_rounds: int = setting(
        6, help="with the yield guard, fewest rounds of an epoch (its first is not measured)", check=positive
    )
    yield_epoch_s: float = setting(
        0.5,
        help="with the yield guard, shortest epoch, seconds (it ends earlier when the load level moves)",
        check=non_negative,
    )
    lookup_drafts: bool = setting(
        True,
        help="add the lookup drafter's free proposals to every request's tree: the tokens that followed the "
        "longest earlier occurrence of the request's suffix in its own text, kept while they repay their verify rows",
    )
    lookup_max_ngram: int = setting(4, help="longest suffix (tokens) the lookup drafter matches", check=positive)
    lookup_corpus: bool = setting(
        True,
        help="the lookup drafter also proposes from the lookup corpus in Redis (what the target wrote for "
        "the zoo's training prompts, seeded by `cosine up` / `cosine profile`): the tokens that followed "
        "the longest occurrence of the request's suffix there, from its domain's text when it has one",
    )
    verify_chunks: str = setting(
        "off",
        help="verification frontiers: verify a request's draft chunk by chunk, its first chunk while the drafters "
        "draft the next on the same hypothesis, and drop a later chunk unverified once a token before it is "
        "rejected; auto: each request's chunk depth from its acceptance, N: chunks of depth N, off: the whole "
        "draft in one pass",
        check=check_verify_chunks,
        metavar="auto|off|N",
    )
    explore_threshold: float = setting(
        0.5,
        help="when a request's recent acceptance rate falls under this, try a less-used drafter",
        check=in_range(0.0, 1.0),
    )
    # batching and pipelining
    rounds_in_flight: int = setting(
        2,
        help="rounds kept in flight (>= 2 lets one batch draft while another verifies; 1 disables pipelining)",
        check=positive,
    )
    pipeline_control: bool = setting(
        True,
        help="with cost control, keep more than one round in flight only while a round's drafting takes "
        "as long as its verify pass (measured online); otherwise one round verifies the whole pool. Off: always "
        "--rounds-in-flight",
    )
    draft_ahead: bool = setting(
        True,
        help="with cost control, when only some requests of a round draft, they draft while the others are "
        "verified and join the next pass with their trees, and a new prompt that needs the drafters' scores "
        "for its domain is scored while its request decodes plainly (inline when it is alone in its round), so the "
        "verifier does not wait for the drafters",
    )
    plain_steps: int = setting(
        4,
        help="when a round drafts nothing and holds every request, the verifier decodes up to this many "
        "tokens of each before it answers (one pass each), saving the round trips between those passes; "
        "a request arriving meanwhile waits for them. 1: a round trip per token",
        check=positive,
    )
    step_lookup: bool = setting(
        True,
        help="with the lookup drafter on, the verifier drafts from each request's own text at every plain step "
        "(the same proposals, priced by the router's calibration), so a round of plain steps still gains "
        "from text that repeats itself, with no round trip between its passes",
    )
    max_batch_requests: int = setting(16, help="most requests in one round", check=positive)
    verify_token_budget: int = setting(1024, help="most tree tokens one verify batch may carry", check=positive)
    max_queue: int = setting(
        1024, help="most requests waiting; beyond it Submit answers RESOURCE_EXHAUSTED", check=positive
    )
    profile_prior_weight: float = setting(
        20.0, help="how many rounds an offline profile counts for against online figures", check=non_negative
    )

    def validate(self) -> str | None:
        if not self.min_k <= self.initial_k <= self.max_k:
            got = f"{self.min_k}, {self.initial_k}, {self.max_k}"
            return f"speculation lengths must satisfy min_k <= initial_k <= max_k (got {got})"
        return None
