"""The router's side of the expertise profiles in Redis, outage-proof.

Reads (the priors of a new request's domain) fall back to no prior while Redis is unreachable:
routing starts uniform and learns from the verdicts as usual, output is unchanged. Writes (the
online acceptance of every round) are summed per (drafter, domain) while Redis is unreachable and
added with the first write that gets through, so a Redis restart loses no online evidence; the
backlog is bounded by drafters x domains.

The domain lexicon (``services/router/lexicon.py``) is read when the drafters would otherwise score a
new prompt (at most every few seconds), and each prompt they score is added; while Redis is out the
router keeps the lexicon it has, and the prompts it learns meanwhile are not shared (the next read
after the outage replaces them with Redis's copy: the lexicon is a shortcut, never needed for output).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from common.logs import get_logger
from common.platform.store import Store, StoreUnavailable, sum_acceptance
from common.spec.lookup_corpus import DomainCorpora
from services.corpus import corpus_from_store
from services.router.lexicon import DomainLexicon

log = get_logger("router.profiles")


class ProfileStore:
    def __init__(self, store: Store):
        self.store = store
        self._backlog: dict[tuple[str, str], tuple[float, float, float]] = {}
        self._lock = asyncio.Lock()
        self.failed_reads = 0
        self.failed_writes = 0

    async def priors(self, drafters: Sequence[str], domain: str) -> dict[str, float]:
        """Each drafter's expected accepted tokens per round on ``domain``; {} while Redis is out."""
        try:
            loaded = await self.store.load_profiles(drafters)
        except StoreUnavailable as exc:
            self.failed_reads += 1
            if self.failed_reads in (1, 10) or self.failed_reads % 100 == 0:
                log.warning("profiles unreadable; routing without priors", error=str(exc), failures=self.failed_reads)
            return {}
        return {d: p.score(domain) for d, p in loaded.items() if domain in p.domains}

    async def record(self, updates: list[tuple[str, str, float, float]]) -> None:
        """Add one round's figures (with whatever an outage held back)."""
        async with self._lock:  # one write at a time: the backlog is taken and given back whole
            totals = sum_acceptance(updates, self._backlog)
            self._backlog = {}
            try:
                await self.store.add_acceptance_totals(totals)
            except StoreUnavailable as exc:
                self._backlog = totals
                self.failed_writes += 1
                if self.failed_writes in (1, 10) or self.failed_writes % 100 == 0:
                    log.warning(
                        "profile update kept for later; Redis unavailable",
                        error=str(exc),
                        pending=len(totals),
                        failures=self.failed_writes,
                    )
                return
            if self.failed_writes:
                log.info("profile updates written after an outage", pending=len(totals))
                self.failed_writes = 0

    async def lexicon(self) -> DomainLexicon | None:
        """The shared domain lexicon (the zoo's seed plus what routers learned); None while Redis is out."""
        try:
            loaded, seeded = await self.store.load_lexicon_and_seeds()
        except StoreUnavailable as exc:
            log.warning("domain lexicon unreadable; the drafters score new prompts meanwhile", error=str(exc))
            return None
        lexicon = DomainLexicon()
        for domain, (examples, counts) in sorted(loaded.items()):
            lexicon.absorb(domain, examples, counts, labelled=domain in seeded)
        log.debug(
            "domain lexicon loaded", prompts={d: n for d, (n, _) in sorted(loaded.items())}, labelled=sorted(seeded)
        )
        return lexicon

    async def corpus(self, known_version: int) -> tuple[int, DomainCorpora | None] | None:
        """The lookup corpus seeded into Redis, when its version differs from ``known_version``
        (:func:`~services.corpus.corpus_from_store`)."""
        return await corpus_from_store(self.store, known_version)

    async def learned(self, domain: str, prompt: Sequence[int]) -> None:
        """Share one prompt the drafters scored; dropped while Redis is out (see the module docstring)."""
        try:
            await self.store.add_to_lexicon(domain, prompt)
        except StoreUnavailable as exc:
            self.failed_writes += 1
            if self.failed_writes in (1, 10) or self.failed_writes % 100 == 0:
                log.warning("lexicon update dropped; Redis unavailable", error=str(exc), failures=self.failed_writes)
