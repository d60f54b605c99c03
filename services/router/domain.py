"""Domain detection and routing vectors for a round (no gRPC here): which domain a new request
belongs to, and the routing vector it starts from.

The domain signal seeds a request's routing vector from the expertise profiles of that domain. Only
the requests that draft in a round are routed: a request decoded plainly needs no domain, and no
drafter scores a prompt that is never drafted for.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from common.spec.types import DraftItem
from services.router.drafting import Drafting, sync_item
from services.router.lexicon import DomainLexicon
from services.router.matching import match_draft_results
from services.router.requests import Counters, ProfileSource, Request
from services.router.routing import RoutingVector
from services.router.settings import RouterSettings

RELOAD_S = 5.0  # the shared lexicon is read again at most this often, and only when drafters would score
GUESS_TOKENS = 256  # a prompt's first tokens that the guess at submission reads (its cost stays bounded)


@dataclass(frozen=True)
class SharedLexicon:
    """The domain lexicon kept in Redis (see ``services/router/profiles.py``): ``load`` reads it
    (None while unreadable), ``learned`` adds a prompt the drafters scored (in the background)."""

    load: Callable[[], Awaitable[DomainLexicon | None]]
    learned: Callable[[str, Sequence[int]], None]


class RequestRouting:
    """Seeds the routing vectors of new drafting requests (domain signal + expertise profiles) and
    follows drafter membership for the others."""

    def __init__(
        self,
        config: RouterSettings,
        drafting: Drafting,
        lexicon: DomainLexicon,
        counters: Counters,
        profiles: ProfileSource | None,
        shared: SharedLexicon | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.drafting = drafting
        self.lexicon = lexicon
        self.counters = counters
        self.profiles = profiles
        self.shared = shared
        self.clock = clock
        self._loaded_at = -math.inf  # when the shared lexicon was last read

    def guess(self, prompt: Sequence[int]) -> str:
        """The lexicon's best guess of a new prompt's domain, trusted or not ("" while it knows too
        little): no drafter pass and no audit, only what the draft gate needs before routing."""
        return self.lexicon.predict(prompt[:GUESS_TOKENS])[0] or ""

    def needs_scores(self, r: Request) -> bool:
        """Whether routing ``r`` takes the drafters' scores of its prompt (a prefill in every live
        drafter): a new request whose domain neither its submitter nor the lexicon gives."""
        if not self.config.routing or r.routing.scores or r.domain:
            return False
        return self.config.domain_detection != "lexicon" or not self.lexicon.confident(r.prompt)

    async def route(self, batch: list[Request], live: list[str]) -> None:
        new = [r for r in batch if not r.routing.scores]
        if new and live and self.config.routing:
            unknown = [r for r in new if not r.domain]
            if unknown:
                await self.detect(unknown, live)
            priors: dict[str, dict[str, float]] = {}
            for domain in sorted({r.domain for r in new}):  # one profile read per domain, not per request
                priors[domain] = await self.profiles(live, domain) if self.profiles else {}
            for r in new:
                r.routing = RoutingVector.seeded(live, priors[r.domain])
        for r in batch:
            if not r.routing.scores:
                r.routing = RoutingVector.seeded(live, {})
            else:
                r.routing.sync(live, {})

    async def detect(self, reqs: list[Request], live: list[str]) -> None:
        """The lexicon's domain where it is trusted, else every live drafter scores the prompt
        (and the lexicon learns from the answer). Before the drafters score, the shared lexicon
        is read again (at most every ``RELOAD_S``): a seed written after this router started, or
        what other routers learned meanwhile, may give the domain without them."""
        guesses: dict[str, str | None] = {}
        to_score = self._decide(reqs, guesses)
        if to_score and self.config.domain_detection == "lexicon" and await self.reload():
            to_score = self._decide(to_score, guesses)
        if to_score:
            await detect_domains(self.drafting, to_score, live)
            self.counters.domains_by_drafters += len(to_score)
            for r in to_score:
                if self.lexicon.learn(r.domain, r.prompt, guesses[r.request_id]) and self.shared is not None:
                    self.shared.learned(r.domain, r.prompt)

    async def reload(self, throttled: bool = True) -> bool:
        """Read the shared lexicon again: whether it was. A router reads it when it starts
        (``throttled`` False: the seed may not be written yet, and the first prompt its drafters would
        score reads it again), and before its drafters would score a prompt, at most every ``RELOAD_S``."""
        if self.shared is None or (throttled and self.clock() - self._loaded_at < RELOAD_S):
            return False
        if throttled:
            self._loaded_at = self.clock()
        fresh = await self.shared.load()
        if fresh is None:
            return False
        fresh.keep_record_of(self.lexicon)
        self.lexicon = fresh
        return True

    def _decide(self, reqs: list[Request], guesses: dict[str, str | None]) -> list[Request]:
        """Give the requests the lexicon's domain where it is trusted; the others, to be scored."""
        to_score = []
        for r in reqs:
            use, guess = self.lexicon.decide(r.prompt) if self.config.domain_detection == "lexicon" else (None, None)
            if use is not None:
                r.domain = use
                self.counters.domains_by_lexicon += 1
            else:
                guesses[r.request_id] = guess
                to_score.append(r)
        return to_score


async def detect_domains(drafting: Drafting, reqs: list[Request], live: list[str]) -> None:
    """Domain signal: every live drafter scores each new prompt (mean log-prob) and
    :func:`infer_domain` picks the domain whose specialist finds it most likely. The drafters
    keep the prompt in cache, so this is also their prefill."""
    calls: dict[str, list[DraftItem]] = {}
    sent = {r.request_id: list(r.sequence) for r in reqs}  # scored in the background, a request may commit meanwhile
    for d in live:
        for r in reqs:
            item, _ = sync_item(r.drafter_cache.get(d, []), sent[r.request_id], top_n=0, score=True)
            calls.setdefault(d, []).append(replace(item, request_id=r.request_id))
    answers = await drafting.call(calls)
    scored = []
    for d, results in answers.items():
        results = match_draft_results([r.request_id for r in reqs], results)
        for r, res in zip(reqs, results):
            if res is not None and res.ok:
                r.drafter_cache[d] = list(sent[r.request_id])
            else:
                r.drafter_cache.pop(d, None)
        scored.append((d, results))
    for i, r in enumerate(reqs):
        r.domain = infer_domain(
            {
                d: results[i].append_logprob
                for d, results in scored
                if results[i] is not None and results[i].ok and results[i].append_logprob is not None
            },
            {d: list(drafting.drafters.domains(d)) for d in live},
        )


def infer_domain(logprobs: Mapping[str, float], domains: Mapping[str, Sequence[str]]) -> str:
    """The request's domain signal from the drafters' mean log-probabilities of its prompt.

    Specialists (drafters of exactly one domain) vote for their domain; the prompt's domain is the
    one whose specialist finds it most likely. Without specialists, the best drafter's first
    domain (or its id) stands in.
    """
    specialists = {d: lp for d, lp in logprobs.items() if len(domains.get(d, ())) == 1}
    pool = specialists or logprobs
    if not pool:
        return ""
    best = max(sorted(pool), key=lambda d: pool[d])
    listed = domains.get(best) or ()
    return listed[0] if listed else best
