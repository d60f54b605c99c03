"""The router's control plane: request pool, pipelined rounds, routing, fusion, verdicts.

No gRPC here: drafters and the verifier are reached through the small :class:`DrafterPool` and
:class:`VerifierBackend` protocols (gRPC stream clients in production, in-process engines in
tests), so the whole round logic is unit-testable.

A **round** for a batch of requests (see DESIGN.md):

1. *sync + select*: every selected drafter's cache is brought to the committed sequence
   (rolled back to the longest common prefix, the rest appended). On a request's first round every
   live drafter scores the prompt; the best-scoring drafter's domain is the request's domain
   signal, which seeds its routing vector from the expertise profiles.
2. *draft*: token fusion (k steps; at each step every selected drafter proposes top-n, the
   routing-weighted best becomes the next tree node and is appended by all of them, runners-up
   become sibling leaves) or chunk fusion (each drafter drafts a k-chain, chains merged).
3. *verify*: all trees of the batch go to the verifier in one message.
4. *apply*: committed tokens grow by the accepted path + the next token; drafters that proposed
   accepted tokens are credited; routing vectors, speculation length and the Redis profiles are
   updated; the tokens are streamed to the request's submitter.

``rounds_in_flight`` workers run rounds concurrently over disjoint batches, so one batch drafts
while another verifies; a request is in at most one round at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from common.logs import get_logger
from common.spec_types import DraftItem, DraftResult, SamplingParams, TokenTree, Verdict, VerifyItem
from services.router.control import SpeculationControl
from services.router.fusion import DraftTree, Proposal, credit, fuse, fuse_chains
from services.router.routing import RoutingVector
from services.router.scheduler import Candidate, LoadControl, SpeculationLength, pick_batch

log = get_logger("router")

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


class VerifierBackend(Protocol):
    async def verify(self, items: Sequence[VerifyItem]) -> tuple[list[Verdict], int]:
        """Verdicts in item order, and the verifier's own busy time for the batch in ns."""
        ...

    def release(self, request_ids: Sequence[str]) -> None: ...


ProfileSource = Callable[[Sequence[str], str], Awaitable[dict[str, float]]]
ProfileSink = Callable[[list[tuple[str, str, float, float]]], Awaitable[None]]


@dataclass(frozen=True)
class RouterConfig:
    min_k: int = 1
    max_k: int = 8
    initial_k: int = 4
    tree_width: int = 3
    drafters_per_request: int = 2
    fusion: str = "token"  # token | chunk
    routing: bool = True
    explore_threshold: float = 0.5
    rounds_in_flight: int = 2
    max_batch_requests: int = 16
    verify_token_budget: int = 1024
    max_queue: int = 1024
    adaptive_k: bool = True
    all_drafters: bool = False  # every live drafter drafts every request (SpecInfer-style)
    cost_control: bool = True  # verify/draft only the nodes that pay (services.router.control)
    speculate: bool = True  # False: plain decoding of the target (no drafter is ever called)

    @classmethod
    def from_settings(cls, s: Any) -> RouterConfig:
        return cls(
            min_k=s.min_k, max_k=s.max_k, initial_k=s.initial_k, tree_width=s.tree_width,
            drafters_per_request=s.drafters_per_request, fusion=s.fusion, routing=s.routing,
            explore_threshold=s.explore_threshold, rounds_in_flight=s.rounds_in_flight,
            max_batch_requests=s.max_batch_requests, verify_token_budget=s.verify_token_budget, max_queue=s.max_queue,
            adaptive_k=s.adaptive_k, all_drafters=s.all_drafters, cost_control=s.cost_control,
            speculate=s.speculate,
        )


@dataclass
class RequestStats:
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafters_used: set[str] = field(default_factory=set)
    accepted_by_drafter: dict[str, int] = field(default_factory=dict)

    @property
    def mean_accepted_len(self) -> float:
        return self.accepted_tokens / self.rounds if self.rounds else 0.0


@dataclass
class Event:
    """What a submitter receives: new tokens, and at the end the finish reason or an error."""

    tokens: tuple[int, ...] = ()
    finished: bool = False
    finish_reason: str = ""
    error: RequestFailed | None = None
    round_ns: int = 0


@dataclass
class Request:
    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    domain: str = ""
    generated: list[int] = field(default_factory=list)
    verifier_synced: bool = False
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

    @property
    def sequence(self) -> list[int]:
        return [*self.prompt, *self.generated]


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
    started_at: float = field(default_factory=time.monotonic)
    by_drafter: dict[str, list[float]] = field(default_factory=dict)  # id -> [rounds, accepted]

    def as_dict(self) -> dict[str, float]:
        wall = time.monotonic() - self.started_at
        return {
            "rounds": self.rounds, "requests_finished": self.requests_finished, "tokens_committed": self.tokens_committed,
            "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens, "draft_s": self.draft_s,
            "verify_s": self.verify_s, "apply_s": self.apply_s, "verifier_busy_s": self.verifier_busy_s, "wall_s": wall,
        }


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def sync_item(cache: Sequence[int], sequence: Sequence[int], top_n: int, chain_len: int = 0, score: bool = False) -> tuple[DraftItem, list[int]]:
    """The draft item that brings a drafter cache holding ``cache`` to ``sequence`` and proposes
    the next position. Returns the item and the cache contents afterwards (the whole sequence).
    At least one token is always appended so the drafter has fresh logits to propose from."""
    keep = min(common_prefix(cache, sequence), len(sequence) - 1)
    truncate_to = keep if keep < len(cache) else -1
    item = DraftItem(request_id="", truncate_to=truncate_to, append_ids=tuple(sequence[keep:]), top_n=top_n)
    if chain_len or score:
        item = replace(item, chain_len=chain_len, score_append=score)
    return item, list(sequence)


class RouterCore:
    def __init__(
        self,
        config: RouterConfig,
        drafters: DrafterPool,
        verifier: VerifierBackend,
        profiles: ProfileSource | None = None,
        record: ProfileSink | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.drafters = drafters
        self.verifier = verifier
        self.profiles = profiles
        self.record = record
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.counters = Counters()
        self.load = LoadControl()
        self.control = SpeculationControl(max_width=config.tree_width, enabled=config.cost_control)
        self._wakeup = asyncio.Event()
        self._workers: list[asyncio.Task[None]] = []
        self._bg: set[asyncio.Task[Any]] = set()
        self.rounds_in_flight = 0
        self._closed = False

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        for i in range(max(1, self.config.rounds_in_flight)):
            self._workers.append(asyncio.create_task(self._worker(i), name=f"round-worker-{i}"))

    async def stop(self) -> None:
        self._closed = True
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        for req in list(self.requests.values()):
            self._finish(req, error=RequestFailed("router shutting down", "unavailable"))
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)

    # ---- submission --------------------------------------------------------------------------

    def submit(self, request_id: str, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
               stop_ids: Sequence[int] = (), domain_hint: str = "") -> Request:
        if self._closed:
            raise RequestFailed("router shutting down", "unavailable")
        if request_id in self.requests:
            raise RequestFailed(f"request {request_id} is already running", "already_exists")
        if len(self.requests) >= self.config.max_queue:
            raise RequestFailed(f"router queue is full ({self.config.max_queue} requests)", "resource_exhausted")
        if not prompt:
            raise RequestFailed("empty prompt", "invalid")
        if max_new_tokens < 1:
            raise RequestFailed("max_new_tokens must be >= 1", "invalid")
        req = Request(
            request_id=request_id, prompt=tuple(prompt), max_new_tokens=max_new_tokens, sampling=sampling,
            stop_ids=frozenset(stop_ids), domain=domain_hint,
            spec=SpeculationLength(self.config.initial_k, self.config.min_k, self.config.max_k),
            ready_since=self.clock(),
        )
        self.requests[request_id] = req
        self._wakeup.set()
        return req

    def cancel(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.done:
            return
        req.cancelled = True
        if not req.in_round:
            self._finish(req, FINISH_CANCELLED)

    # ---- rounds ------------------------------------------------------------------------------

    async def _worker(self, index: int) -> None:
        while True:
            await asyncio.sleep(0)  # let submissions and cancellations in between rounds
            batch = self._pick()
            if not batch:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self.rounds_in_flight += 1
            try:
                await self._round(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug must not kill the worker; fail the batch loudly
                log.exception("round failed", error=str(exc), requests=[r.request_id for r in batch])
                for req in batch:
                    self._finish(req, error=RequestFailed(f"internal error in round: {exc}", "internal"))
            finally:
                self.rounds_in_flight -= 1
                for req in batch:
                    req.in_round = False
                    req.ready_since = self.clock()
                    if req.cancelled and not req.done:
                        self._finish(req, FINISH_CANCELLED)
                self._wakeup.set()

    def _pick(self) -> list[Request]:
        now = self.clock()
        waiting = [r for r in self.requests.values() if not r.in_round and not r.done]
        if not waiting:
            return []
        width = self.config.tree_width if self.config.fusion == "token" else max(1, self.config.drafters_per_request)
        cands = [
            Candidate(
                r.request_id, now - r.ready_since, self._k(r), width,
                0 if r.verifier_synced else len(r.prompt),
                (r.routing.recent_acceptance() or 0.5) * self._k(r) + 1,
            )
            for r in waiting
        ]
        chosen = pick_batch(cands, self.config.verify_token_budget, self.config.max_batch_requests, self.config.max_k)
        batch = [self.requests[c.request_id] for c in chosen]
        for r in batch:
            r.in_round = True
        return batch

    def _k(self, req: Request) -> int:
        k = req.spec.k if self.config.adaptive_k else self.config.initial_k
        return self.load.apply(k, self.config.min_k, self.config.max_k) if self.config.adaptive_k else k

    async def _round(self, batch: list[Request]) -> None:
        t0 = self.clock()
        live = list(self.drafters.live()) if self.config.speculate else []
        await self._route(batch, live)
        ks = {r.request_id: min(self._k(r), r.max_new_tokens - len(r.generated)) if self._drafts_pay(r) else 0
              for r in batch}
        if self.config.fusion == "chunk":
            trees, selected = await self._draft_chunks(batch, ks)
        else:
            trees, selected = await self._draft_tokens(batch, ks)
        t1 = self.clock()
        items = [
            VerifyItem(
                request_id=r.request_id,
                append_ids=() if r.verifier_synced else r.prompt,
                tree=_to_token_tree(trees[r.request_id]),
                sampling=r.sampling,
            )
            for r in batch
        ]
        try:
            verdicts, busy_ns = await self.verifier.verify(items)
        except Exception as exc:
            for r in batch:
                self._finish(r, error=RequestFailed(f"verifier unavailable: {exc}", "unavailable"))
            return
        t2 = self.clock()
        updates: list[tuple[str, str, float, float]] = []
        committed_before = self.counters.tokens_committed
        for r, verdict in zip(batch, verdicts):
            self._apply(r, trees[r.request_id], selected.get(r.request_id, []), verdict, updates, int((t2 - t0) * 1e9))
        rows = sum(len(it.append_ids) + len(it.tree.tokens) + 1 for it in items)
        self.control.observe_pass(rows, busy_ns / 1e9, self.counters.tokens_committed - committed_before)
        self.control.observe_round(t1 - t0, t2 - t1)
        self.counters.rounds += 1
        self.counters.draft_s += t1 - t0
        self.counters.verify_s += t2 - t1
        self.counters.verifier_busy_s += busy_ns / 1e9
        if t2 > t0:
            self.load.observe(min(1.0, busy_ns / 1e9 / max(t2 - t0, 1e-9)))
        if updates and self.record is not None:
            self._background(self.record(updates))
        self.counters.apply_s += self.clock() - t2

    async def _route(self, batch: list[Request], live: list[str]) -> None:
        """Seed routing vectors of new requests (domain signal + profiles); follow membership."""
        new = [r for r in batch if not r.routing.scores]
        if new and live and self.config.routing:
            if any(not r.domain for r in new):
                await self._score_prompts([r for r in new if not r.domain], live)
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

    async def _score_prompts(self, reqs: list[Request], live: list[str]) -> None:
        """Domain signal: every live drafter scores each new prompt (mean log-prob) and
        :func:`infer_domain` picks the domain whose specialist finds it most likely. The drafters
        keep the prompt in cache, so this is also their prefill."""
        calls: dict[str, list[tuple[str, DraftItem]]] = {}
        for d in live:
            for r in reqs:
                item, _ = sync_item(r.drafter_cache.get(d, []), r.sequence, top_n=0, score=True)
                calls.setdefault(d, []).append((r.request_id, replace(item, request_id=r.request_id)))
        answers = await self._call_drafters(calls)
        scored = []
        for d, results in answers.items():
            for r, res in zip(reqs, results or [None] * len(reqs)):
                if res is not None and res.ok:
                    r.drafter_cache[d] = list(r.sequence)
                else:
                    r.drafter_cache.pop(d, None)
            scored.append((d, results or []))
        for i, r in enumerate(reqs):
            r.domain = infer_domain(
                {d: results[i].append_logprob for d, results in scored
                 if i < len(results) and results[i].ok and results[i].append_logprob is not None},
                {d: list(self.drafters.domains(d)) for d in live},
            )

    def _drafts_pay(self, r: Request) -> bool:
        """Whether drafting for ``r`` this round is expected to pay: its first node's acceptance
        rate against the control threshold; a request turned down to plain decoding is probed
        with a draft every eighth round, so a change of load or of text turns it back on."""
        if not self.config.speculate:
            return False
        if not self.config.cost_control:
            return True
        return r.first_accept >= self.control.threshold() or r.stats.rounds % 8 == 0

    def _select(self, r: Request, live: list[str]) -> list[str]:
        if not live:
            return []
        if self.config.all_drafters:
            return sorted(live)
        count = self.control.drafters_per_request(self.config.drafters_per_request)
        if not self.config.routing:
            return sorted(live)[:count]
        chosen = r.routing.select(count, self.config.explore_threshold)
        return [d for d in chosen if d in live]

    async def _draft_tokens(self, batch: list[Request], ks: Mapping[str, int]) -> tuple[dict[str, DraftTree], dict[str, list[str]]]:
        live = list(self.drafters.live())
        width = self.config.tree_width
        selected = {r.request_id: self._select(r, live) if ks[r.request_id] > 0 else [] for r in batch}
        trees = {r.request_id: DraftTree(drafter_ids=list(selected[r.request_id])) for r in batch}
        tips = {r.request_id: -1 for r in batch}
        fused: dict[str, list[int]] = {r.request_id: [] for r in batch}
        by_id = {r.request_id: r for r in batch}
        active = {rid for rid, sel in selected.items() if sel}
        values = {rid: 1.0 for rid in active}  # expected acceptance of each request's fused tip
        theta = self.control.threshold() if self.config.cost_control else 0.0
        pipelined = self.config.rounds_in_flight > 1
        step = 0
        while active:
            per_drafter: dict[str, list[tuple[str, DraftItem]]] = {}
            for rid in sorted(active):
                r = by_id[rid]
                for d in selected[rid]:
                    if step == 0:
                        item, after = sync_item(r.drafter_cache.get(d, []), r.sequence, top_n=width)
                        r.drafter_cache[d] = after
                    else:
                        item = DraftItem(request_id="", append_ids=(fused[rid][-1],), top_n=width)
                        r.drafter_cache[d].append(fused[rid][-1])
                    per_drafter.setdefault(d, []).append((rid, replace(item, request_id=rid)))
            t_step = self.clock()
            answers = await self._call_drafters(per_drafter)
            self.control.observe_draft_step(self.clock() - t_step)
            proposals: dict[str, list[Proposal]] = {rid: [] for rid in active}
            for d, pairs in per_drafter.items():
                results = answers.get(d) or [None] * len(pairs)
                for (rid, _), res in zip(pairs, results):
                    if res is not None and res.ok and res.token_ids:
                        proposals[rid].append(Proposal(d, tuple(res.token_ids), tuple(res.probs)))
                    else:  # the drafter failed for this request: it leaves the request's round
                        by_id[rid].drafter_cache.pop(d, None)
                        selected[rid] = [x for x in selected[rid] if x != d]
            step += 1
            next_values = []
            for rid in list(active):
                ranked = fuse(proposals[rid], by_id[rid].routing.weights(selected[rid]))
                # a node is verified only when its expected tokens repay its verify row
                kept = [c for c in ranked[:width] if self.control.node_value(values[rid], c.score) >= theta]
                if not kept or kept[0] is not ranked[0]:
                    active.discard(rid)
                    if kept:  # the fused token does not pay but a runner-up does: keep the runners-up as leaves
                        for c in kept:
                            trees[rid].add(tips[rid], c.token, c.score, c.sources, c.top1)
                    continue
                tips[rid] = trees[rid].add_fused_step(tips[rid], kept, len(kept))
                values[rid] = self.control.node_value(values[rid], ranked[0].score)
                fused[rid].append(ranked[0].token)
                if step >= ks[rid] or not selected[rid]:
                    active.discard(rid)
                else:
                    next_values.append(values[rid])
            if active and self.config.cost_control and not self.control.worth_a_step(next_values, pipelined):
                active.clear()
        return trees, selected

    async def _draft_chunks(self, batch: list[Request], ks: Mapping[str, int]) -> tuple[dict[str, DraftTree], dict[str, list[str]]]:
        live = list(self.drafters.live())
        selected = {r.request_id: self._select(r, live) if ks[r.request_id] > 0 else [] for r in batch}
        per_drafter: dict[str, list[tuple[str, DraftItem]]] = {}
        by_id = {r.request_id: r for r in batch}
        for r in batch:
            for d in selected[r.request_id]:
                item, after = sync_item(r.drafter_cache.get(d, []), r.sequence, top_n=1, chain_len=ks[r.request_id])
                r.drafter_cache[d] = after
                per_drafter.setdefault(d, []).append((r.request_id, replace(item, request_id=r.request_id)))
        answers = await self._call_drafters(per_drafter)
        chains: dict[str, dict[str, tuple[list[int], list[float]]]] = {r.request_id: {} for r in batch}
        for d, pairs in per_drafter.items():
            results = answers.get(d)
            for (rid, _), res in zip(pairs, results or []):
                positions = getattr(res, "positions", None) or ((res.token_ids, res.probs),)
                if res.ok and positions and positions[0][0]:
                    chain = [int(ids[0]) for ids, _ in positions]
                    probs = [float(ps[0]) for _, ps in positions]
                    chains[rid][d] = (chain, probs)
                    by_id[rid].drafter_cache[d].extend(chain[:-1])
                else:
                    by_id[rid].drafter_cache.pop(d, None)
            if results is None:
                for rid, _ in pairs:
                    by_id[rid].drafter_cache.pop(d, None)
        trees = {
            r.request_id: fuse_chains(chains[r.request_id], r.routing.weights(chains[r.request_id]), max(1, len(chains[r.request_id])))
            for r in batch
        }
        if self.config.cost_control:
            trees = {rid: self.control.prune(tree) for rid, tree in trees.items()}
        return trees, {rid: sorted(c) for rid, c in chains.items()}

    async def _call_drafters(self, per_drafter: Mapping[str, list[tuple[str, DraftItem]]]) -> dict[str, list[DraftResult] | None]:
        """One draft step for every drafter involved (one message per drafter process). A failed
        drafter answers None and has left the pool; its requests go on without it."""
        answers = await self.drafters.draft_many({d: [item for _, item in pairs] for d, pairs in per_drafter.items()})
        for d, results in answers.items():
            if results is None:
                log.warning("drafter failed; its requests go on without it", drafter=d)
        return answers

    def _apply(self, r: Request, tree: DraftTree, selected: list[str], verdict: Verdict,
               updates: list[tuple[str, str, float, float]], round_ns: int) -> None:
        if r.done:
            return
        if not verdict.ok:
            kind = getattr(verdict, "error_kind", "") or "internal"
            self._finish(r, error=RequestFailed(verdict.error, kind))
            return
        r.verifier_synced = True
        accepted = len(verdict.accepted_nodes)
        if len(tree):
            self.control.observe_verdict(tree, verdict.accepted_nodes)
            r.first_accept = 0.7 * r.first_accept + 0.3 * (1.0 if accepted else 0.0)
        r.stats.rounds += 1
        r.stats.draft_tokens += len(tree)
        r.stats.accepted_tokens += accepted
        self.counters.draft_tokens += len(tree)
        self.counters.accepted_tokens += accepted
        credited = credit(tree, verdict.accepted_nodes)
        depth = tree.depth()
        for d in selected:
            r.stats.drafters_used.add(d)
            got = credited.get(d, 0)
            if got:
                r.stats.accepted_by_drafter[d] = r.stats.accepted_by_drafter.get(d, 0) + got
            stats = self.counters.by_drafter.setdefault(d, [0.0, 0.0])
            stats[0] += 1
            stats[1] += got
            if r.domain:
                updates.append((d, r.domain, float(got), float(depth)))
        confidence = {d: _mean_confidence(tree, d) for d in selected}
        r.routing.update(credited, confidence, selected, accepted, depth)
        r.spec.update(accepted, depth)
        new: list[int] = []
        reason = ""
        for tok in verdict.new_tokens:
            new.append(int(tok))
            if tok in r.stop_ids:
                reason = FINISH_EOS
                break
            if len(r.generated) + len(new) >= r.max_new_tokens:
                reason = FINISH_LENGTH
                break
        r.generated.extend(new)
        self.counters.tokens_committed += len(new)
        r.events.put_nowait(Event(tokens=tuple(new), round_ns=round_ns))
        if reason:
            self._finish(r, reason)

    def _finish(self, r: Request, reason: str = "", error: RequestFailed | None = None) -> None:
        if r.done:
            return
        r.done = True
        self.requests.pop(r.request_id, None)
        self.counters.requests_finished += 1
        r.events.put_nowait(Event(finished=True, finish_reason=reason, error=error))
        holders = list(r.drafter_cache)
        for d in holders:
            try:
                self.drafters.release(d, [r.request_id])
            except Exception as exc:
                log.debug("drafter release failed", drafter=d, error=str(exc))
        r.drafter_cache.clear()
        try:
            self.verifier.release([r.request_id])
        except Exception as exc:
            log.debug("verifier release failed", error=str(exc))

    def _background(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._bg.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._bg.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("profile update failed", error=str(t.exception()))

        task.add_done_callback(done)

    # ---- introspection -----------------------------------------------------------------------

    def queue_depth(self) -> int:
        return sum(1 for r in self.requests.values() if not r.in_round)

    def drafter_acceptance(self) -> dict[str, tuple[float, float]]:
        return {d: (v[0], v[1] / v[0] if v[0] else 0.0) for d, v in self.counters.by_drafter.items()}


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


def _mean_confidence(tree: DraftTree, drafter: str) -> float:
    probs = [p for p, top in zip(tree.probs, tree.top1) if drafter in top]
    return sum(probs) / len(probs) if probs else 0.0


def _to_token_tree(tree: DraftTree) -> TokenTree:
    return TokenTree(
        tokens=tuple(tree.tokens), parents=tuple(tree.parents), draft_probs=tuple(tree.probs),
        source_masks=tuple(tree.source_masks), drafter_ids=tuple(tree.drafter_ids),
    )
