"""What the routers share through Redis: the drafters' expertise profiles, the domain lexicon and
the lookup corpus (their key layout: ``common/platform/store.py``)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from common.platform.store_outage import outage

PROFILE_FIELDS = ("prior", "prior_weight", "rounds", "accepted", "proposed")


@dataclass(frozen=True)
class DomainStats:
    prior: float = 0.0
    prior_weight: float = 0.0
    rounds: float = 0.0
    accepted: float = 0.0
    proposed: float = 0.0

    def score(self) -> float:
        """Smoothed mean accepted draft tokens per round (0 when nothing is known)."""
        weight = self.prior_weight + self.rounds
        if weight <= 0:
            return 0.0
        return (self.prior * self.prior_weight + self.accepted) / weight


@dataclass(frozen=True)
class DrafterProfile:
    drafter_id: str
    domains: Mapping[str, DomainStats] = field(default_factory=dict)

    def score(self, domain: str) -> float:
        stats = self.domains.get(domain)
        return stats.score() if stats else 0.0


class SharedKnowledge:
    """The profile, lexicon and corpus part of :class:`common.platform.store.Store` (which sets ``_r`` and "
    "``prefix``)."""

    _r: aioredis.Redis
    prefix: str

    def profile_key(self, drafter_id: str) -> str:
        return f"{self.prefix}:profile:{drafter_id}"

    def lexicon_key(self, kind: str, domain: str) -> str:
        return f"{self.prefix}:lexicon:{kind}:{domain}"

    def corpus_key(self, domain: str) -> str:
        return f"{self.prefix}:corpus:{domain}"

    def corpus_version_key(self) -> str:
        return f"{self.prefix}:corpus-version"

    def corpus_digest_key(self) -> str:
        return f"{self.prefix}:corpus-digest"

    # ---- expertise profiles ----------------------------------------------------------------

    @outage
    async def seed_profile(
        self, drafter_id: str, priors: Mapping[str, float], prior_weight: float, reset: bool = False
    ) -> None:
        """Write offline acceptance figures (domain -> mean accepted per round) as priors."""
        key = self.profile_key(drafter_id)
        async with self._r.pipeline(transaction=True) as pipe:
            if reset:
                pipe.delete(key)
            mapping: dict[str, float] = {}
            for domain, value in priors.items():
                mapping[f"{domain}|prior"] = float(value)
                mapping[f"{domain}|prior_weight"] = float(prior_weight)
            if mapping:
                pipe.hset(key, mapping=mapping)
            await pipe.execute()

    async def record_acceptance(self, updates: Iterable[tuple[str, str, float, float]]) -> None:
        """Add online figures: (drafter_id, domain, accepted tokens, proposed tokens), one round each."""
        await self.add_acceptance_totals(sum_acceptance(updates))

    @outage
    async def add_acceptance_totals(self, totals: Mapping[tuple[str, str], tuple[float, float, float]]) -> None:
        """Add summed online figures: (drafter_id, domain) -> (rounds, accepted, proposed)."""
        async with self._r.pipeline(transaction=False) as pipe:
            for (drafter_id, domain), (rounds, accepted, proposed) in totals.items():
                key = self.profile_key(drafter_id)
                pipe.hincrbyfloat(key, f"{domain}|rounds", float(rounds))
                pipe.hincrbyfloat(key, f"{domain}|accepted", float(accepted))
                pipe.hincrbyfloat(key, f"{domain}|proposed", float(proposed))
            await pipe.execute()

    @outage
    async def load_profiles(self, drafter_ids: Iterable[str]) -> dict[str, DrafterProfile]:
        ids = list(drafter_ids)
        async with self._r.pipeline(transaction=False) as pipe:
            for drafter_id in ids:
                pipe.hgetall(self.profile_key(drafter_id))
            raw = await pipe.execute()
        return {drafter_id: _parse_profile(drafter_id, fields) for drafter_id, fields in zip(ids, raw)}

    @outage
    async def profile_ids(self) -> list[str]:
        prefix = self.profile_key("")
        return sorted([key[len(prefix) :] async for key in self._r.scan_iter(match=prefix + "*", count=200)])

    # ---- domain lexicon --------------------------------------------------------------------

    @outage
    async def seed_lexicon(self, domains: Mapping[str, tuple[int, Mapping[int, int]]], reset: bool = False) -> None:
        """Write the seed lexicon (domain -> (prompts, token id -> count)), replacing any earlier
        seed; ``reset`` also drops what routers learned online."""
        stale = [
            key async for key in self._r.scan_iter(match=self.lexicon_key("seed" if not reset else "*", "*"), count=200)
        ]
        async with self._r.pipeline(transaction=True) as pipe:
            if stale:
                pipe.delete(*stale)
            for domain, (examples, counts) in domains.items():
                pipe.hset(
                    self.lexicon_key("seed", domain),
                    mapping={"examples": int(examples), **{str(t): int(c) for t, c in counts.items()}},
                )
            await pipe.execute()

    @outage
    async def add_to_lexicon(self, domain: str, tokens: Iterable[int]) -> None:
        """Count one more prompt of ``domain`` (its token ids) in the learned lexicon."""
        key = self.lexicon_key("learned", domain)
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hincrby(key, "examples", 1)
            for token, count in Counter(int(t) for t in tokens).items():
                pipe.hincrby(key, str(token), count)
            await pipe.execute()

    async def load_lexicon(self) -> dict[str, tuple[int, dict[int, int]]]:
        """Seed and learned lexicon summed: domain -> (prompts, token id -> count)."""
        return (await self.load_lexicon_and_seeds())[0]

    @outage
    async def load_lexicon_and_seeds(self) -> tuple[dict[str, tuple[int, dict[int, int]]], set[str]]:
        """:meth:`load_lexicon`'s lexicon, and the domains the seed holds labelled prompts of (see
        :meth:`seed_lexicon`), from one read."""
        keys = sorted([key async for key in self._r.scan_iter(match=self.lexicon_key("*", "*"), count=200)])
        seed_prefix = self.lexicon_key("seed", "")
        async with self._r.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(key)
            raw = await pipe.execute()
        out: dict[str, tuple[int, dict[int, int]]] = {}
        for key, fields in zip(keys, raw):
            domain = key.split(":")[-1]
            examples, counts = out.get(domain, (0, {}))
            for name, value in fields.items():
                if name == "examples":
                    examples += int(value)
                else:
                    counts[int(name)] = counts.get(int(name), 0) + int(value)
            out[domain] = (examples, counts)
        return out, {key[len(seed_prefix) :] for key in keys if key.startswith(seed_prefix)}

    @outage
    async def seed_corpus(self, corpus: Mapping[str, Iterable[Sequence[int]]]) -> bool:
        """Replace the lookup corpus with ``corpus`` (domain -> token sequences). Writes nothing and
        returns False when that very corpus is seeded already: every router reloads the corpus
        when its version moves (parsing and indexing it costs the router CPU time beside the verifier's),
        so re-seeding profiles must not move it for nothing."""
        rows = {
            domain: [" ".join(str(int(t)) for t in seq) for seq in sequences] for domain, sequences in corpus.items()
        }
        digest = hashlib.sha256(json.dumps(sorted(rows.items())).encode()).hexdigest()
        seeded, version = await self._r.mget(self.corpus_digest_key(), self.corpus_version_key())
        if seeded == digest and version:
            return False
        stale = [key async for key in self._r.scan_iter(match=self.corpus_key("*"), count=200)]
        async with self._r.pipeline(transaction=True) as pipe:
            if stale:
                pipe.delete(*stale)
            for domain, domain_rows in rows.items():
                if domain_rows:
                    pipe.rpush(self.corpus_key(domain), *domain_rows)
            pipe.set(self.corpus_digest_key(), digest)
            pipe.incr(self.corpus_version_key())
            await pipe.execute()
        return True

    @outage
    async def corpus_version(self) -> int:
        """How many times the lookup corpus was seeded (0: never)."""
        return int(await self._r.get(self.corpus_version_key()) or 0)

    @outage
    async def load_corpus(self) -> dict[str, list[list[int]]]:
        """The lookup corpus: domain -> token sequences ({} when none was seeded)."""
        keys = sorted([key async for key in self._r.scan_iter(match=self.corpus_key("*"), count=200)])
        async with self._r.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.lrange(key, 0, -1)
            raw = await pipe.execute()
        return {key.split(":")[-1]: [[int(t) for t in row.split()] for row in rows] for key, rows in zip(keys, raw)}


def sum_acceptance(
    updates: Iterable[tuple[str, str, float, float]],
    into: dict[tuple[str, str], tuple[float, float, float]] | None = None,
) -> dict[tuple[str, str], tuple[float, float, float]]:
    """Per-round updates (drafter_id, domain, accepted, proposed) summed per (drafter_id, domain)
    into (rounds, accepted, proposed), added to ``into`` when given."""
    out = {} if into is None else into
    for d, dom, accepted, proposed in updates:
        r, a, p = out.get((d, dom), (0.0, 0.0, 0.0))
        out[(d, dom)] = (r + 1.0, a + float(accepted), p + float(proposed))
    return out


def _parse_profile(drafter_id: str, fields: Mapping[str, str]) -> DrafterProfile:
    per_domain: dict[str, dict[str, float]] = {}
    for name, value in fields.items():
        domain, _, stat = name.rpartition("|")
        if stat in PROFILE_FIELDS and domain:
            per_domain.setdefault(domain, {})[stat] = float(value)
    return DrafterProfile(drafter_id, {d: DomainStats(**v) for d, v in per_domain.items()})
