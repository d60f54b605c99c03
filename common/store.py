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

``{p}:lexicon:seed:{domain}``, ``{p}:lexicon:learned:{domain}`` (hashes) - the routers' domain
  lexicon (:mod:`services.router.lexicon`): per token id its count over the domain's prompts, and
  ``examples`` (the prompts counted). ``seed`` holds the zoo's training prompts (written by
  ``cosine up`` and the benchmarks; idempotent), ``learned`` what routers added online from the prompts
  their drafters scored (HINCRBY). A router reads the sum of both before its drafters would score a
  new prompt (at most every few seconds), so a restarted or added router routes its first requests
  without drafter passes.

``{p}:corpus:{domain}`` (list) - the routers' lookup corpus (:mod:`services.router.lookup_corpus`):
  token sequences the target wrote (the zoo's teacher continuations of its training prompts), one
  space-separated string each. Written by ``cosine up``, ``cosine profile`` and the benchmarks
  (replaced whole). ``{p}:corpus-version`` (integer) counts the seedings: a router reads the corpus
  when it starts and again whenever the version moved (it checks every few seconds).

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

Outages (Redis restarting, unreachable for a while): every method raises
:class:`StoreUnavailable` (never a raw redis or socket error), except the two writes a running
request makes, which must not fail the request: :meth:`Store.append_tokens` keeps tokens it
could not write and writes them, in order and exactly once, with the next call that reaches
Redis; :meth:`Store.delete_request` remembers a delete it could not make and makes it then.
Both return whether Redis is up to date. A reconnect after a Redis restart is transparent (one
immediate retry on a stale pooled connection). What survives a Redis restart is Redis's own
persistence (``appendonly yes``: see the deployment notes).
"""

from __future__ import annotations

import functools
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from common.logs import get_logger

DEFAULT_PREFIX = "cosine"

PROFILE_FIELDS = ("prior", "prior_weight", "rounds", "accepted", "proposed")


log = get_logger("store")

OUTAGE_ERRORS = (RedisError, OSError)
POOL_CONNECTIONS = 64  # Redis connections one process keeps at most
POOL_WAIT_S = 10.0  # how long a command waits for one of them before it counts as an outage


class StoreUnavailable(RuntimeError):
    """Redis could not be reached or answered with an error. A servicer maps it to UNAVAILABLE
    (``common.grpc_server.StoreOutageInterceptor`` does it for any it lets through)."""


T = TypeVar("T")


def _outage(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Turn redis and socket errors of a Store method into :class:`StoreUnavailable`."""

    @functools.wraps(fn)
    async def wrapped(*args: Any, **kwargs: Any) -> T:
        try:
            return await fn(*args, **kwargs)
        except OUTAGE_ERRORS as exc:
            raise StoreUnavailable(f"Redis unavailable: {exc or type(exc).__name__}") from exc

    return wrapped


# Append a running request's new tokens exactly once. KEYS: request hash, token list. ARGV: the
# offset of the first token (tokens already in the list are skipped: a retried write is
# harmless), status, now, ttl, tokens... Returns the list length, or -1 when the request's state
# is gone (Redis lost it: nothing partial is written), -2 when tokens before the offset are missing.
_APPEND_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local have = redis.call('LLEN', KEYS[2])
local start = tonumber(ARGV[1])
if start < 0 then start = have end
if have < start then return -2 end
for i = have - start + 5, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
local total = redis.call('LLEN', KEYS[2])
redis.call('HSET', KEYS[1], 'committed', total, 'status', ARGV[2], 'updated_at', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
if total > 0 then redis.call('EXPIRE', KEYS[2], ARGV[4]) end
return total
"""


# What a Redis outage raises through the Store. Every Store method now raises StoreUnavailable
# alone (append_tokens and delete_request raise nothing for an outage); catching this tuple
# stays correct.
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
        self._append = client.register_script(_APPEND_SCRIPT)
        self._written: dict[str, int] = {}  # request id -> tokens known to be in Redis
        self._unwritten: dict[str, list[int]] = {}  # request id -> tokens not written yet (outage)
        self._undeleted: set[str] = set()  # requests whose delete failed (outage)
        self.outage_writes = 0  # writes deferred by an outage (figures for logs and tests)

    @classmethod
    def from_url(cls, url: str, prefix: str = DEFAULT_PREFIX, request_ttl_s: int = 3600) -> Store:
        # one immediate retry: after a Redis restart the first command meets a stale pooled connection.
        # A burst of requests (hundreds of streams admitted at once) waits for a pooled connection
        # instead of failing with "Too many connections" once the pool is out of them.
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=POOL_CONNECTIONS, timeout=POOL_WAIT_S,
                                                        decode_responses=True, socket_connect_timeout=3, socket_timeout=10,
                                                        retry=Retry(NoBackoff(), 1))
        return cls(aioredis.Redis.from_pool(pool), prefix, request_ttl_s)  # closing the client closes the pool

    async def ping(self) -> None:
        """Raise StoreUnavailable with a readable reason when Redis is not reachable."""
        try:
            await self._r.ping()
        except OUTAGE_ERRORS as exc:
            raise StoreUnavailable(str(exc) or type(exc).__name__) from exc

    def backlog(self) -> dict[str, int]:
        """Writes an outage deferred: requests with unwritten tokens, and deletes not made yet."""
        return {"requests": len(self._unwritten), "tokens": sum(map(len, self._unwritten.values())),
                "deletes": len(self._undeleted)}

    async def close(self) -> None:
        await self._r.aclose()

    # ---- keys ----------------------------------------------------------------------------

    def profile_key(self, drafter_id: str) -> str:
        return f"{self.prefix}:profile:{drafter_id}"

    def lexicon_key(self, kind: str, domain: str) -> str:
        return f"{self.prefix}:lexicon:{kind}:{domain}"

    def corpus_key(self, domain: str) -> str:
        return f"{self.prefix}:corpus:{domain}"

    def corpus_version_key(self) -> str:
        return f"{self.prefix}:corpus-version"

    def request_key(self, request_id: str) -> str:
        return f"{self.prefix}:request:{request_id}"

    def tokens_key(self, request_id: str) -> str:
        return f"{self.prefix}:request:{request_id}:tokens"

    def member_key(self, role: str, member_id: str) -> str:
        return f"{self.prefix}:member:{role}:{member_id}"

    # ---- expertise profiles ----------------------------------------------------------------

    @_outage
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
        await self.add_acceptance_totals(sum_acceptance(updates))

    @_outage
    async def add_acceptance_totals(self, totals: Mapping[tuple[str, str], tuple[float, float, float]]) -> None:
        """Add summed online figures: (drafter_id, domain) -> (rounds, accepted, proposed)."""
        async with self._r.pipeline(transaction=False) as pipe:
            for (drafter_id, domain), (rounds, accepted, proposed) in totals.items():
                key = self.profile_key(drafter_id)
                pipe.hincrbyfloat(key, f"{domain}|rounds", float(rounds))
                pipe.hincrbyfloat(key, f"{domain}|accepted", float(accepted))
                pipe.hincrbyfloat(key, f"{domain}|proposed", float(proposed))
            await pipe.execute()

    @_outage
    async def load_profiles(self, drafter_ids: Iterable[str]) -> dict[str, DrafterProfile]:
        ids = list(drafter_ids)
        async with self._r.pipeline(transaction=False) as pipe:
            for drafter_id in ids:
                pipe.hgetall(self.profile_key(drafter_id))
            raw = await pipe.execute()
        return {drafter_id: _parse_profile(drafter_id, fields) for drafter_id, fields in zip(ids, raw)}

    @_outage
    async def profile_ids(self) -> list[str]:
        prefix = self.profile_key("")
        return sorted([key[len(prefix) :] async for key in self._r.scan_iter(match=prefix + "*", count=200)])

    # ---- domain lexicon --------------------------------------------------------------------

    @_outage
    async def seed_lexicon(self, domains: Mapping[str, tuple[int, Mapping[int, int]]], reset: bool = False) -> None:
        """Write the seed lexicon (domain -> (prompts, token id -> count)), replacing any earlier
        seed; ``reset`` also drops what routers learned online."""
        stale = [key async for key in self._r.scan_iter(match=self.lexicon_key("seed" if not reset else "*", "*"), count=200)]
        async with self._r.pipeline(transaction=True) as pipe:
            if stale:
                pipe.delete(*stale)
            for domain, (examples, counts) in domains.items():
                pipe.hset(self.lexicon_key("seed", domain), mapping={"examples": int(examples), **{str(t): int(c) for t, c in counts.items()}})
            await pipe.execute()

    @_outage
    async def add_to_lexicon(self, domain: str, tokens: Iterable[int]) -> None:
        """Count one more prompt of ``domain`` (its token ids) in the learned lexicon."""
        key = self.lexicon_key("learned", domain)
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hincrby(key, "examples", 1)
            for token, count in Counter(int(t) for t in tokens).items():
                pipe.hincrby(key, str(token), count)
            await pipe.execute()

    @_outage
    async def load_lexicon(self) -> dict[str, tuple[int, dict[int, int]]]:
        """Seed and learned lexicon summed: domain -> (prompts, token id -> count)."""
        keys = sorted([key async for key in self._r.scan_iter(match=self.lexicon_key("*", "*"), count=200)])
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
        return out

    @_outage
    async def seed_corpus(self, corpus: Mapping[str, Iterable[Sequence[int]]]) -> None:
        """Replace the lookup corpus with ``corpus`` (domain -> token sequences)."""
        stale = [key async for key in self._r.scan_iter(match=self.corpus_key("*"), count=200)]
        async with self._r.pipeline(transaction=True) as pipe:
            if stale:
                pipe.delete(*stale)
            for domain, sequences in corpus.items():
                rows = [" ".join(str(int(t)) for t in seq) for seq in sequences]
                if rows:
                    pipe.rpush(self.corpus_key(domain), *rows)
            pipe.incr(self.corpus_version_key())
            await pipe.execute()

    @_outage
    async def corpus_version(self) -> int:
        """How many times the lookup corpus was seeded (0: never)."""
        return int(await self._r.get(self.corpus_version_key()) or 0)

    @_outage
    async def load_corpus(self) -> dict[str, list[list[int]]]:
        """The lookup corpus: domain -> token sequences ({} when none was seeded)."""
        keys = sorted([key async for key in self._r.scan_iter(match=self.corpus_key("*"), count=200)])
        async with self._r.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.lrange(key, 0, -1)
            raw = await pipe.execute()
        return {key.split(":")[-1]: [[int(t) for t in row.split()] for row in rows] for key, rows in zip(keys, raw)}

    # ---- request state ---------------------------------------------------------------------

    @_outage
    async def create_request(self, request_id: str, prompt_ids: list[int], params: Mapping[str, Any], owner: str) -> None:
        """Claim ``request_id`` cluster-wide and write its state. Raises :class:`RequestExists`
        (touching nothing) when a request with that id is already running, and
        :class:`StoreUnavailable` when Redis cannot take the state (the request must not start)."""
        await self._flush_deletes()
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
        self._written[request_id] = 0

    async def append_tokens(self, request_id: str, token_ids: list[int], status: str = "running") -> bool:
        """Append a running request's new tokens and set its status. Never raises for an outage:
        returns False and keeps the tokens, which the next call for the request writes first (each
        token lands exactly once, in order). False also when Redis lost the request's state."""
        pending = self._unwritten.setdefault(request_id, [])
        pending.extend(int(t) for t in token_ids)
        start = self._written.get(request_id, -1)
        try:
            total = await self._append(keys=[self.request_key(request_id), self.tokens_key(request_id)],
                                       args=[start, status, time.time(), self.request_ttl_s, *pending])
        except OUTAGE_ERRORS as exc:
            self.outage_writes += 1
            if self.outage_writes in (1, 10) or self.outage_writes % 100 == 0:
                log.warning("request state not written; kept for the next write", request_id=request_id,
                            unwritten=len(pending), error=str(exc) or type(exc).__name__, deferred=self.outage_writes)
            return False
        del self._unwritten[request_id]
        if total < 0:
            log.warning("request state lost by Redis; not rewritten", request_id=request_id,
                        reason="gone" if total == -1 else "tokens missing")
            self._written.pop(request_id, None)
            return False
        if start >= 0:
            self._written[request_id] = int(total)
        try:
            await self._flush_deletes()
        except StoreUnavailable:  # Redis went away after the append: the deletes wait for the next write
            pass
        return True

    @_outage
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

    async def delete_request(self, request_id: str) -> bool:
        """Remove a request's state. Never raises for an outage: returns False and makes the
        delete with the next Store write that reaches Redis (or the keys expire by themselves)."""
        self._unwritten.pop(request_id, None)
        self._written.pop(request_id, None)
        self._undeleted.add(request_id)
        try:
            await self._flush_deletes()
        except StoreUnavailable:
            return False
        return True

    async def _flush_deletes(self) -> None:
        if not self._undeleted:
            return
        ids = sorted(self._undeleted)
        try:
            await self._r.delete(*(k for rid in ids for k in (self.request_key(rid), self.tokens_key(rid))))
        except OUTAGE_ERRORS as exc:
            raise StoreUnavailable(f"Redis unavailable: {exc or type(exc).__name__}") from exc
        self._undeleted.difference_update(ids)

    @_outage
    async def request_ids(self) -> list[str]:
        prefix = self.request_key("")
        ids = []
        async for key in self._r.scan_iter(match=prefix + "*", count=500):
            rest = key[len(prefix) :]
            if not rest.endswith(":tokens"):
                ids.append(rest)
        return sorted(ids)

    # ---- membership ------------------------------------------------------------------------

    @_outage
    async def register(self, member: Member, ttl_s: float) -> None:
        """Create or renew a membership entry (also the heartbeat)."""
        value = json.dumps(
            {"address": member.address, "info": dict(member.info), "started_at": member.started_at or time.time()},
            sort_keys=True,
        )
        await self._r.set(self.member_key(member.role, member.member_id), value, px=max(1, int(ttl_s * 1000)))

    @_outage
    async def deregister(self, role: str, member_id: str) -> None:
        await self._r.delete(self.member_key(role, member_id))

    @_outage
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


def sum_acceptance(updates: Iterable[tuple[str, str, float, float]],
                   into: dict[tuple[str, str], tuple[float, float, float]] | None = None) -> dict[tuple[str, str], tuple[float, float, float]]:
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
