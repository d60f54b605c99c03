"""What the cluster's members write about their requests and themselves: per-request state (the
gateway's, for resuming a stream) and service membership (key layout: ``common/platform/store.py``)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from common.logs import get_logger
from common.platform.store_outage import OUTAGE_ERRORS, StoreUnavailable, outage

log = get_logger("store")

# Append a running request's new tokens exactly once. KEYS: request hash, token list. ARGV: the
# offset of the first token (tokens already in the list are skipped: a retried write is
# harmless), status, now, ttl, tokens... Returns the list length, or -1 when the request's state
# is gone (Redis lost it: nothing partial is written), -2 when tokens before the offset are missing.
APPEND_SCRIPT = """
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


class RequestExists(RuntimeError):
    """A request with this id is already running somewhere in the cluster."""


@dataclass(frozen=True)
class Member:
    role: str
    member_id: str
    address: str
    info: Mapping[str, Any] = field(default_factory=dict)
    started_at: float = 0.0


class RequestState:
    """The request-state part of :class:`common.platform.store.Store` (which sets these attributes)."""

    _r: aioredis.Redis
    prefix: str
    request_ttl_s: int
    _append: Any  # APPEND_SCRIPT, registered
    _written: dict[str, int]
    _unwritten: dict[str, list[int]]
    _undeleted: set[str]
    outage_writes: int

    def request_key(self, request_id: str) -> str:
        return f"{self.prefix}:request:{request_id}"

    def tokens_key(self, request_id: str) -> str:
        return f"{self.prefix}:request:{request_id}:tokens"

    @outage
    async def create_request(
        self, request_id: str, prompt_ids: list[int], params: Mapping[str, Any], owner: str
    ) -> None:
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
            total = await self._append(
                keys=[self.request_key(request_id), self.tokens_key(request_id)],
                args=[start, status, time.time(), self.request_ttl_s, *pending],
            )
        except OUTAGE_ERRORS as exc:
            self.outage_writes += 1
            if self.outage_writes in (1, 10) or self.outage_writes % 100 == 0:
                log.warning(
                    "request state not written; kept for the next write",
                    request_id=request_id,
                    unwritten=len(pending),
                    error=str(exc) or type(exc).__name__,
                    deferred=self.outage_writes,
                )
            return False
        del self._unwritten[request_id]
        if total < 0:
            log.warning(
                "request state lost by Redis; not rewritten",
                request_id=request_id,
                reason="gone" if total == -1 else "tokens missing",
            )
            self._written.pop(request_id, None)
            return False
        if start >= 0:
            self._written[request_id] = int(total)
        try:
            await self._flush_deletes()
        except StoreUnavailable:  # Redis went away after the append: the deletes wait for the next write
            pass
        return True

    @outage
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

    @outage
    async def request_ids(self) -> list[str]:
        prefix = self.request_key("")
        ids = []
        async for key in self._r.scan_iter(match=prefix + "*", count=500):
            rest = key[len(prefix) :]
            if not rest.endswith(":tokens"):
                ids.append(rest)
        return sorted(ids)


class Membership:
    """The membership part of :class:`common.platform.store.Store`: who serves what, renewed by heartbeats."""

    _r: aioredis.Redis
    prefix: str

    def member_key(self, role: str, member_id: str) -> str:
        return f"{self.prefix}:member:{role}:{member_id}"

    @outage
    async def register(self, member: Member, ttl_s: float) -> None:
        """Create or renew a membership entry (also the heartbeat)."""
        value = json.dumps(
            {"address": member.address, "info": dict(member.info), "started_at": member.started_at or time.time()},
            sort_keys=True,
        )
        await self._r.set(self.member_key(member.role, member.member_id), value, px=max(1, int(ttl_s * 1000)))

    @outage
    async def deregister(self, role: str, member_id: str) -> None:
        await self._r.delete(self.member_key(role, member_id))

    @outage
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
            out.append(
                Member(role, key[len(prefix) :], data["address"], data.get("info", {}), data.get("started_at", 0.0))
            )
        return out
