"""The one module that talks to Redis.

Key layout (every key starts with the configurable prefix, ``cosine`` by default):

``{p}:profile:{drafter_id}`` (hash) - expertise profile of one drafter. Per domain ``d``:
    ``d|prior``        mean accepted draft tokens per round measured offline (the zoo's matrix)
    ``d|prior_weight`` how many rounds the prior counts for
    ``d|rounds``       rounds this drafter took part in online, for requests of domain d
    ``d|accepted``     draft tokens it proposed that the target accepted, summed over those rounds
    ``d|proposed``     draft tokens it proposed, summed
  The routing signal is the smoothed mean ``(prior*prior_weight + accepted)/(prior_weight + rounds)``
  (see :meth:`DrafterProfile.score`). Updated online by the router with HINCRBYFLOAT.

``{p}:request:{request_id}`` (hash) - state of one in-flight request, written by the gateway:
    ``prompt_ids`` (JSON list), ``params`` (JSON object), ``status`` (queued | running | done |
    failed | cancelled), ``created_at`` / ``updated_at`` (unix seconds), ``committed`` (number
    of committed new tokens), ``owner`` (which gateway). Expires after ``request_ttl_s``; the
    key and its token list are deleted when the request ends.
``{p}:request:{request_id}:tokens`` (list) - committed new token ids, appended per round.

``{p}:member:{role}:{member_id}`` (string, JSON) - service membership. ``role`` is drafter,
    verifier, router or gateway; the value holds the address and what the member serves. It
    carries a TTL renewed by the member's heartbeat, so a crashed member disappears by itself;
    a clean shutdown deletes it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

DEFAULT_PREFIX = "cosine"

PROFILE_FIELDS = ("prior", "prior_weight", "rounds", "accepted", "proposed")


class StoreUnavailable(RuntimeError):
    """Redis could not be reached or answered with an error."""


# What a Redis outage raises through the Store: callers that must survive one catch these.
STORE_ERRORS: tuple[type[BaseException], ...] = (StoreUnavailable, RedisError, OSError)


class RequestExists(RuntimeError):
    """A request with this id is already running somewhere in the cluster."""


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


@dataclass(frozen=True)
class Member:
    role: str
    member_id: str
    address: str
    info: Mapping[str, Any] = field(default_factory=dict)
    started_at: float = 0.0


class Store:
    """Async access to CoSine's Redis keys. One instance per process; pass it down."""

    def __init__(self, client: aioredis.Redis, prefix: str = DEFAULT_PREFIX, request_ttl_s: int = 3600):
        self._r = client
        self.prefix = prefix
        self.request_ttl_s = request_ttl_s

    @classmethod
    def from_url(cls, url: str, prefix: str = DEFAULT_PREFIX, request_ttl_s: int = 3600) -> Store:
        client = aioredis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=3, socket_timeout=10)
        return cls(client, prefix, request_ttl_s)

    async def ping(self) -> None:
        """Raise StoreUnavailable with a readable reason when Redis is not reachable."""
        try:
            await self._r.ping()
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(str(exc) or type(exc).__name__) from exc

    async def close(self) -> None:
        await self._r.aclose()

    # ---- keys ----------------------------------------------------------------------------

    def profile_key(self, drafter_id: str) -> str:
        return f"{self.prefix}:profile:{drafter_id}"

    def request_key(self, request_id: str) -> str:
        return f"{self.prefix}:request:{request_id}"

    def tokens_key(self, request_id: str) -> str:
        return f"{self.prefix}:request:{request_id}:tokens"

    def member_key(self, role: str, member_id: str) -> str:
        return f"{self.prefix}:member:{role}:{member_id}"

    # ---- expertise profiles ----------------------------------------------------------------

    async def seed_profile(self, drafter_id: str, priors: Mapping[str, float], prior_weight: float, reset: bool = False) -> None:
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
        async with self._r.pipeline(transaction=False) as pipe:
            for drafter_id, domain, accepted, proposed in updates:
                key = self.profile_key(drafter_id)
                pipe.hincrbyfloat(key, f"{domain}|rounds", 1.0)
                pipe.hincrbyfloat(key, f"{domain}|accepted", float(accepted))
                pipe.hincrbyfloat(key, f"{domain}|proposed", float(proposed))
            await pipe.execute()

    async def load_profiles(self, drafter_ids: Iterable[str]) -> dict[str, DrafterProfile]:
        ids = list(drafter_ids)
        async with self._r.pipeline(transaction=False) as pipe:
            for drafter_id in ids:
                pipe.hgetall(self.profile_key(drafter_id))
            raw = await pipe.execute()
        return {drafter_id: _parse_profile(drafter_id, fields) for drafter_id, fields in zip(ids, raw)}

    async def profile_ids(self) -> list[str]:
        prefix = self.profile_key("")
        return sorted([key[len(prefix) :] async for key in self._r.scan_iter(match=prefix + "*", count=200)])

    # ---- request state ---------------------------------------------------------------------

    async def create_request(self, request_id: str, prompt_ids: list[int], params: Mapping[str, Any], owner: str) -> None:
        """Claim ``request_id`` cluster-wide and write its state. Raises :class:`RequestExists`
        (touching nothing) when a request with that id is already running."""
        now = time.time()
        key = self.request_key(request_id)
        if not await self._r.hsetnx(key, "owner", owner):  # atomic claim: one writer per id in the cluster
            raise RequestExists(f"request {request_id} is already running")
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hset(
                key,
                mapping={
                    "prompt_ids": json.dumps(prompt_ids),
                    "params": json.dumps(dict(params), sort_keys=True),
                    "status": "queued",
                    "created_at": now,
                    "updated_at": now,
                    "committed": 0,
                    "owner": owner,
                },
            )
            pipe.expire(key, self.request_ttl_s)
            await pipe.execute()

    async def append_tokens(self, request_id: str, token_ids: list[int], status: str = "running") -> None:
        key, tokens = self.request_key(request_id), self.tokens_key(request_id)
        async with self._r.pipeline(transaction=True) as pipe:
            if token_ids:
                pipe.rpush(tokens, *token_ids)
                pipe.hincrby(key, "committed", len(token_ids))
            pipe.hset(key, mapping={"status": status, "updated_at": time.time()})
            pipe.expire(key, self.request_ttl_s)
            pipe.expire(tokens, self.request_ttl_s)
            await pipe.execute()

    async def get_request(self, request_id: str) -> dict[str, Any] | None:
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hgetall(self.request_key(request_id))
            pipe.lrange(self.tokens_key(request_id), 0, -1)
            fields, tokens = await pipe.execute()
        if not fields:
            return None
        out: dict[str, Any] = dict(fields)
        out["prompt_ids"] = json.loads(fields.get("prompt_ids", "[]"))
        out["params"] = json.loads(fields.get("params", "{}"))
        out["committed"] = int(fields.get("committed", 0))
        out["tokens"] = [int(t) for t in tokens]
        return out

    async def delete_request(self, request_id: str) -> None:
        await self._r.delete(self.request_key(request_id), self.tokens_key(request_id))

    async def request_ids(self) -> list[str]:
        prefix = self.request_key("")
        ids = []
        async for key in self._r.scan_iter(match=prefix + "*", count=500):
            rest = key[len(prefix) :]
            if not rest.endswith(":tokens"):
                ids.append(rest)
        return sorted(ids)

    # ---- membership ------------------------------------------------------------------------

    async def register(self, member: Member, ttl_s: float) -> None:
        """Create or renew a membership entry (also the heartbeat)."""
        value = json.dumps(
            {"address": member.address, "info": dict(member.info), "started_at": member.started_at or time.time()},
            sort_keys=True,
        )
        await self._r.set(self.member_key(member.role, member.member_id), value, px=max(1, int(ttl_s * 1000)))

    async def deregister(self, role: str, member_id: str) -> None:
        await self._r.delete(self.member_key(role, member_id))

    async def members(self, role: str) -> list[Member]:
        prefix = self.member_key(role, "")
        keys = sorted([key async for key in self._r.scan_iter(match=prefix + "*", count=200)])
        if not keys:
            return []
        values = await self._r.mget(keys)
        out = []
        for key, value in zip(keys, values):
            if value is None:  # expired between SCAN and MGET
                continue
            data = json.loads(value)
            out.append(Member(role, key[len(prefix) :], data["address"], data.get("info", {}), data.get("started_at", 0.0)))
        return out


def _parse_profile(drafter_id: str, fields: Mapping[str, str]) -> DrafterProfile:
    per_domain: dict[str, dict[str, float]] = {}
    for name, value in fields.items():
        domain, _, stat = name.rpartition("|")
        if stat in PROFILE_FIELDS and domain:
            per_domain.setdefault(domain, {})[stat] = float(value)
    return DrafterProfile(drafter_id, {d: DomainStats(**v) for d, v in per_domain.items()})
