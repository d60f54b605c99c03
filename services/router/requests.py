"""The router's request pool: requests, their statistics and events, counters, and the contracts
of the parts the router drives (drafter pool, verifier, profile store). No gRPC here."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.spec.types import DraftItem, DraftResult, SamplingParams, Verdict, VerifyItem
from common.spec.fusion import DraftTree
from common.spec.lookup_index import LookupIndex
from services.router.routing import RoutingVector
from services.router.scheduler import SpeculationLength

FINISH_LENGTH, FINISH_EOS, FINISH_STOP, FINISH_CANCELLED = "length", "eos", "stop", "cancelled"


class RequestFailed(RuntimeError):
    """A request cannot go on. ``kind`` maps to a status code at the servicer."""

    def __init__(self, message: str, kind: str = "internal"):
        super().__init__(message)
        self.kind = kind


class DrafterPool(Protocol):
    def live(self) -> Sequence[str]: ...

    def domains(self, drafter_id: str) -> Sequence[str]: ...

    async def draft_many(self, calls: Mapping[str, Sequence[DraftItem]]) -> dict[str, list[DraftResult] | None]:
        """One step for several drafters at once; None for a drafter that failed (and left)."""
        ...

    def release(self, drafter_id: str, request_ids: Sequence[str]) -> None: ...

    def mark_failed(self, drafter_id: str, reason: str) -> None: ...

    # A pool whose drafter processes can fuse a request's tokens themselves also has (the router
    # looks them up and drives token fusion step by step where they are missing):
    #   fusion_host(request_id, drafters) -> str | None: the one process serving all of them, if any;
    #   async fuse(host, width, pricing, requests) -> (outcomes, step seconds) | None: a fused round there.


class VerifierBackend(Protocol):
    async def verify(self, items: Sequence[VerifyItem]) -> tuple[list[Verdict], int]:
        """Verdicts in item order, and the verifier's own busy time for the batch in ns."""
        ...

    def release(self, request_ids: Sequence[str]) -> None: ...

    # A verifier that timed its pass by rows when it loaded the target also has (the router prices
    # rows by the passes it runs alone where it is missing):
    #   pass_times -> Sequence[(rows, seconds)]: common/runtime/pass_times.py


ProfileSource = Callable[[Sequence[str], str], Awaitable[dict[str, float]]]
ProfileSink = Callable[[list[tuple[str, str, float, float]]], Awaitable[None]]


@dataclass(frozen=True)
class RouterConfig:
    min_k: int = 1
    max_k: int = 8
    initial_k: int = 4
    tree_width: int = 3
    drafters_per_request: int = 2
    fusion: str = "chunk"  # chunk | token (chunk: one drafter call a round; docs/design.md, *Fusion*)
    local_fusion: bool = True  # token fusion of a request inside the drafter process that hosts all its drafters
    routing: bool = True
    explore_threshold: float = 0.5
    rounds_in_flight: int = 2
    max_batch_requests: int = 16
    verify_token_budget: int = 1024
    max_queue: int = 1024
    adaptive_k: bool = True
    all_drafters: bool = False  # every live drafter drafts every request (SpecInfer-style)
    cost_control: bool = True  # verify/draft only the nodes that pay (services.router.control)
    draft_pricing: bool = True  # a request drafts only when its first node also repays the drafters' time
    pipeline_control: bool = True  # a second round in flight only while drafting outlasts the verifier's pass
    draft_ahead: bool = True  # with cost control, drafting and new prompts' scoring run while other requests are verified
    lookup: bool = True  # the lookup drafter proposes from the request's own text (services.router.lookup)
    lookup_max_ngram: int = 4
    lookup_corpus: bool = True  # and from the lookup corpus, when one is loaded (common.spec.lookup_corpus)
    speculate: bool = True  # False: plain decoding of the target (no drafter is ever called)
    domain_detection: str = "lexicon"  # lexicon (learned from drafter scores, then no passes) | drafters (always score)
    gate_by_domain: bool = True  # the draft gate keeps its records per domain (services.router.gate)
    probe_share: float = 0.03  # the most of the router's time probes' drafting may take (services.router.gate)
    plain_steps: int = 4  # a round that drafts nothing: tokens the verifier decodes before it answers (scheduler.plain_steps)
    step_lookup: bool = True  # with lookup on, the verifier drafts from the request's text at each plain step (VerifyItem.step_lookup)

    @classmethod
    def from_settings(cls, s: Any) -> RouterConfig:
        return cls(
            min_k=s.min_k, max_k=s.max_k, initial_k=s.initial_k, tree_width=s.tree_width,
            drafters_per_request=s.drafters_per_request, fusion=s.fusion, local_fusion=s.local_fusion, routing=s.routing,
            explore_threshold=s.explore_threshold, rounds_in_flight=s.rounds_in_flight,
            max_batch_requests=s.max_batch_requests, verify_token_budget=s.verify_token_budget, max_queue=s.max_queue,
            adaptive_k=s.adaptive_k, all_drafters=s.all_drafters, cost_control=s.cost_control, draft_pricing=s.draft_pricing,
            pipeline_control=s.pipeline_control, draft_ahead=s.draft_ahead, lookup=s.lookup_drafts, lookup_max_ngram=s.lookup_max_ngram,
            lookup_corpus=s.lookup_corpus,
            speculate=s.speculate, domain_detection=s.domain_detection, gate_by_domain=s.domain_gate,
            probe_share=s.probe_share, plain_steps=s.plain_steps, step_lookup=s.step_lookup,
        )


@dataclass
class RequestStats:
    rounds: int = 0  # the verify passes it was in (a round's plain steps count one each)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafters_used: set[str] = field(default_factory=set)
    accepted_by_drafter: dict[str, int] = field(default_factory=dict)

    @property
    def mean_accepted_len(self) -> float:
        return self.accepted_tokens / self.rounds if self.rounds else 0.0

    def credit(self, drafter: str, accepted: int) -> None:
        """``drafter`` drafted for the request, and ``accepted`` of its tokens were accepted."""
        self.drafters_used.add(drafter)
        if accepted:
            self.accepted_by_drafter[drafter] = self.accepted_by_drafter.get(drafter, 0) + accepted


@dataclass
class Event:
    """What a submitter receives: new tokens, and at the end the finish reason or an error."""

    tokens: tuple[int, ...] = ()
    finished: bool = False
    finish_reason: str = ""
    error: RequestFailed | None = None
    round_ns: int = 0


@dataclass(frozen=True)
class AheadDraft:
    """A request's tree drafted while the rest of its round was verified (``RouterCore._round``);
    it is verified in the request's next round, which finds the committed sequence unchanged."""

    tree: DraftTree
    selected: tuple[str, ...]  # the drafters that drafted it
    committed: int  # len(sequence) it was drafted from


@dataclass
class Request:
    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    domain: str = ""
    domain_guess: str = ""  # the domain lexicon's best guess at submission (the draft gate's domain until routed)
    generated: list[int] = field(default_factory=list)
    verifier_synced: bool = False
    resumes: int = 0  # consecutive rounds the verifier lost this request (see resume.py)
    drafter_cache: dict[str, list[int]] = field(default_factory=dict)
    routing: RoutingVector = field(default_factory=RoutingVector)
    spec: SpeculationLength = field(default_factory=lambda: SpeculationLength(4, 1, 8))
    stats: RequestStats = field(default_factory=RequestStats)
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    ready_since: float = field(default_factory=time.monotonic)
    in_round: bool = False
    done: bool = False
    cancelled: bool = False
    first_accept: float = 0.7  # EWMA: how often this request's first draft node is accepted
    lookup: LookupIndex = field(default_factory=LookupIndex)  # n-grams of the committed sequence
    probing: bool = False  # this round's draft is a probe (see RouterCore._drafts_pay)
    probe_hit: bool = False  # and its first drafted node was accepted
    probed_at: int = -1  # the router round of this request's latest probe (-1: never probed)
    drafting_ahead: bool = False  # its drafters are drafting while the rest of its round is verified
    ahead: AheadDraft | None = None  # what they drafted, verified in its next round
    routing_ahead: bool = False  # being routed (its prompt scored by the drafters) while it decodes plainly
    plain_streak: int = 0  # its latest rounds in a row verified with nothing drafted (scheduler.plain_steps)

    @property
    def sequence(self) -> list[int]:
        return [*self.prompt, *self.generated]

    @property
    def under_way(self) -> bool:
        """It has had a round (a resumed one too), so it holds a slot of the running batch
        (``scheduler.pick_batch`` ranks it before every new request)."""
        return self.verifier_synced or bool(self.generated)


@dataclass
class Counters:
    rounds: int = 0
    requests_finished: int = 0
    tokens_committed: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    apply_s: float = 0.0
    verifier_busy_s: float = 0.0
    draft_ahead_s: float = 0.0  # drafting that overlapped another batch's verify pass (off the rounds' path)
    rounds_drafted_ahead: int = 0  # rounds whose drafting requests drafted while the others were verified
    routed_ahead: int = 0  # new requests routed (and their prompts read by their drafters) while they decoded plainly
    domains_by_lexicon: int = 0  # new requests whose domain the lexicon gave (no drafter pass)
    domains_by_drafters: int = 0  # new requests every live drafter scored
    lookup_tokens: int = 0  # draft tokens the lookup drafter put in trees
    lookup_accepted: int = 0  # of them, accepted by the target
    corpus_tokens: int = 0  # of the lookup tokens, those the lookup corpus proposed
    corpus_accepted: int = 0  # of them, accepted by the target
    corpus_sequences: int = 0  # sequences in the router's lookup corpus
    plain_step_passes: int = 0  # verify passes run as plain steps of an earlier pass's batch (no round of their own)
    step_lookup_tokens: int = 0  # of the draft tokens, those the verifier drafted at plain steps (lookup, text and corpus)
    step_lookup_accepted: int = 0  # of them, accepted by the target
    started_at: float = field(default_factory=time.monotonic)
    by_drafter: dict[str, list[float]] = field(default_factory=dict)  # id -> [rounds, accepted]

    @property
    def verify_passes(self) -> int:
        """Verify passes run: a round's own pass, and one per plain step after it."""
        return self.rounds + self.plain_step_passes

    def as_dict(self) -> dict[str, float]:
        wall = time.monotonic() - self.started_at
        return {
            "rounds": self.rounds, "requests_finished": self.requests_finished, "tokens_committed": self.tokens_committed,
            "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens, "draft_s": self.draft_s,
            "verify_s": self.verify_s, "apply_s": self.apply_s, "draft_ahead_s": self.draft_ahead_s,
            "rounds_drafted_ahead": self.rounds_drafted_ahead, "routed_ahead": self.routed_ahead, "verifier_busy_s": self.verifier_busy_s, "wall_s": wall,
            "domains_by_lexicon": self.domains_by_lexicon, "domains_by_drafters": self.domains_by_drafters,
            "lookup_tokens": self.lookup_tokens, "lookup_accepted": self.lookup_accepted,
            "corpus_tokens": self.corpus_tokens, "corpus_accepted": self.corpus_accepted, "corpus_sequences": self.corpus_sequences,
            "plain_step_passes": self.plain_step_passes, "verify_passes": self.verify_passes,
            "step_lookup_tokens": self.step_lookup_tokens, "step_lookup_accepted": self.step_lookup_accepted,
        }
