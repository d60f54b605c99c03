"""The one place that talks to Redis: :class:`Store`, assembled from its parts by concern
(``store_knowledge.py``: profiles, lexicon, corpus; ``store_state.py``: request state, membership;
``store_outage.py``: what an outage raises).

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

``{p}:corpus:{domain}`` (list) - the routers' lookup corpus (:mod:`common.spec.lookup_corpus`):
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

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from common.platform.store_knowledge import DomainStats, DrafterProfile, SharedKnowledge, sum_acceptance
from common.platform.store_outage import OUTAGE_ERRORS, STORE_ERRORS, StoreUnavailable
from common.platform.store_state import APPEND_SCRIPT, Member, Membership, RequestExists, RequestState

# the names the services import from here
__all__ = [
    "DEFAULT_PREFIX",
    "POOL_CONNECTIONS",
    "STORE_ERRORS",
    "DomainStats",
    "DrafterProfile",
    "Member",
    "RequestExists",
    "Store",
    "StoreUnavailable",
    "sum_acceptance",
]

DEFAULT_PREFIX = "cosine"
POOL_CONNECTIONS = 64  # Redis connections one process keeps at most
POOL_WAIT_S = 10.0  # how long a command waits for one of them before it counts as an outage


class Store(SharedKnowledge, RequestState, Membership):
    """Async access to CoSine's Redis keys. One instance per process; pass it down."""

    def __init__(self, client: aioredis.Redis, prefix: str = DEFAULT_PREFIX, request_ttl_s: int = 3600):
        self._r = client
        self.prefix = prefix
        self.request_ttl_s = request_ttl_s
        self._append = client.register_script(APPEND_SCRIPT)
        self._written: dict[str, int] = {}  # request id -> tokens known to be in Redis
        self._unwritten: dict[str, list[int]] = {}  # request id -> tokens not written yet (outage)
        self._undeleted: set[str] = set()  # requests whose delete failed (outage)
        self.outage_writes = 0  # writes deferred by an outage (figures for logs and tests)

    @classmethod
    def from_url(cls, url: str, prefix: str = DEFAULT_PREFIX, request_ttl_s: int = 3600) -> Store:
        # one immediate retry: after a Redis restart the first command meets a stale pooled connection.
        # A burst of requests (hundreds of streams admitted at once) waits for a pooled connection
        # instead of failing with "Too many connections" once the pool is out of them.
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=POOL_CONNECTIONS,
            timeout=POOL_WAIT_S,
            decode_responses=True,
            socket_connect_timeout=3,
            socket_timeout=10,
            retry=Retry(NoBackoff(), 1),
        )
        return cls(aioredis.Redis.from_pool(pool), prefix, request_ttl_s)  # closing the client closes the pool

    async def ping(self) -> None:
        """Raise StoreUnavailable with a readable reason when Redis is not reachable."""
        try:
            await self._r.ping()
        except OUTAGE_ERRORS as exc:
            raise StoreUnavailable(str(exc) or type(exc).__name__) from exc

    def backlog(self) -> dict[str, int]:
        """Writes an outage deferred: requests with unwritten tokens, and deletes not made yet."""
        return {
            "requests": len(self._unwritten),
            "tokens": sum(map(len, self._unwritten.values())),
            "deletes": len(self._undeleted),
        }

    async def close(self) -> None:
        await self._r.aclose()
