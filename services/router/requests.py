"""The router's request pool: requests, their statistics and events, counters, and the contracts
of the parts the router drives (drafter pool, verifier, profile store). No gRPC here."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from common.spec.fusion import DraftTree
from common.spec.lookup_index import LookupIndex
from common.spec.types import NO_LOGPROBS, DraftItem, DraftResult, SamplingParams, TokenLogprob, Verdict, VerifyItem
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


@dataclass
class RequestStats:
    rounds: int = 0  # the verify passes it was in (a round's plain steps count one each)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafters_used: set[str] = field(default_factory=set)
    accepted_by_drafter: dict[str, int] = field(default_factory=dict)
    grammar_pruned_tokens: int = 0  # draft tokens its constraint forbade (pruned before verification)

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
    """What a submitter receives: new tokens (with their log-probabilities, one each, when the
    request asked), and at the end the finish reason or an error."""

    tokens: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finished: bool = False
    finish_reason: str = ""
    error: RequestFailed | None = None
    round_ns: int = 0


@dataclass(frozen=True)
class AheadDraft:
    """A request's tree drafted while the rest of its round was verified (``RouterCore._round``), or
    the part of a chunk drafted beside its pass that the verdict left standing (``frontiers.py``);
    it is verified in the request's next round, which finds the committed sequence unchanged."""

    tree: DraftTree
    selected: tuple[str, ...]  # the drafters that drafted it
    committed: int  # len(sequence) it was drafted from (or is rooted on)
    depth_left: int = 0  # a chunk's: the depth its draft has left, drafted beside its pass (frontiers.py)


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
    logprobs: int = NO_LOGPROBS  # what its verify items ask for (VerifyItem.logprobs)
    prompt_len: int = 0  # of ``prompt``, the prompt proper (the rest: output a resumed stream had; penalties)

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
    step_lookup_tokens: int = (
        0  # of the draft tokens, those the verifier drafted at plain steps (lookup, text and corpus)
    )
    step_lookup_accepted: int = 0  # of them, accepted by the target
    guard_plain_rounds: int = 0  # rounds the yield guard ran plain (its control groups, and where it withdrew drafting)
    guard_withdrawals: int = 0  # times the yield guard withdrew speculation at a load level
    guard_readmissions: int = 0  # times it let speculation back in at one
    grammar_pruned: int = 0  # draft tokens constrained requests' grammars forbade (pruned, never verified)
    # verification frontiers (frontiers.py): drafted rows by what became of them, and the verifier's wait
    rows_verified: int = 0  # drafted tree nodes the verifier checked (plain steps' lookup drafts aside)
    rows_accepted: int = 0  # of them, accepted
    rows_beyond_rejection: int = 0  # of them, under a node that was not accepted (they could commit nothing)
    rows_pruned: int = 0  # drafted nodes of later chunks dropped unverified after a rejection before them
    frontier_chunks: int = 0  # later chunks drafted beside a pass
    frontier_chunks_kept: int = 0  # of them, verified next (the verdict ran through their first token)
    verifier_wait_s: float = 0.0  # seconds the verifier waited for drafts (no verify call while a round drafted)
    started_at: float = field(default_factory=time.monotonic)
    by_drafter: dict[str, list[float]] = field(default_factory=dict)  # id -> [rounds, accepted]

    @property
    def verify_passes(self) -> int:
        """Verify passes run: a round's own pass, and one per plain step after it."""
        return self.rounds + self.plain_step_passes

    def as_dict(self) -> dict[str, float]:
        wall = time.monotonic() - self.started_at
        return {
            "rounds": self.rounds,
            "requests_finished": self.requests_finished,
            "tokens_committed": self.tokens_committed,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "apply_s": self.apply_s,
            "draft_ahead_s": self.draft_ahead_s,
            "rounds_drafted_ahead": self.rounds_drafted_ahead,
            "routed_ahead": self.routed_ahead,
            "verifier_busy_s": self.verifier_busy_s,
            "wall_s": wall,
            "domains_by_lexicon": self.domains_by_lexicon,
            "domains_by_drafters": self.domains_by_drafters,
            "lookup_tokens": self.lookup_tokens,
            "lookup_accepted": self.lookup_accepted,
            "corpus_tokens": self.corpus_tokens,
            "corpus_accepted": self.corpus_accepted,
            "corpus_sequences": self.corpus_sequences,
            "plain_step_passes": self.plain_step_passes,
            "verify_passes": self.verify_passes,
            "step_lookup_tokens": self.step_lookup_tokens,
            "step_lookup_accepted": self.step_lookup_accepted,
            "guard_plain_rounds": self.guard_plain_rounds,
            "guard_withdrawals": self.guard_withdrawals,
            "guard_readmissions": self.guard_readmissions,
            "grammar_pruned": self.grammar_pruned,
            "rows_verified": self.rows_verified,
            "rows_accepted": self.rows_accepted,
            "rows_beyond_rejection": self.rows_beyond_rejection,
            "rows_pruned": self.rows_pruned,
            "frontier_chunks": self.frontier_chunks,
            "frontier_chunks_kept": self.frontier_chunks_kept,
            "verifier_wait_s": self.verifier_wait_s,
        }
