"""The router's request pool: submission, cancellation, hand-back after a round, finishing, and
which of the waiting requests the next round takes (batch scheduling, ``scheduler.pick_batch``).

A request lives in :attr:`RequestPool.requests` from :meth:`RequestPool.submit` until it finishes
(end of sequence, length, a stop token, cancellation or an error); between its rounds it waits in
the pool (``in_round`` false) for a worker of :class:`services.router.core.RouterCore` to pick it
(:meth:`RequestPool._pick`).
Finishing releases what the drafters and the verifier hold of it. The rounds themselves are
``core.py``'s; this part knows nothing of drafting or verifying.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from common.logs import get_logger
from common.spec.lookup_index import LookupIndex
from common.spec.types import NO_LOGPROBS, SamplingParams
from services.router.admission import SubmitLimits, check_submission
from services.router.control import SpeculationControl
from services.router.domain import RequestRouting
from services.router.gate import DraftGate
from services.router.requests import (
    FINISH_CANCELLED,
    Counters,
    DrafterPool,
    Event,
    Request,
    RequestFailed,
    VerifierBackend,
)
from services.router.resume import VERIFIER_RETRY, mark_for_resume
from services.router.scheduler import Candidate, LoadControl, SpeculationLength, pick_batch
from services.router.settings import RouterSettings
from services.router.yield_guard import YieldGuard

log = get_logger("router")


class RequestPool:
    """The pool part of :class:`services.router.core.RouterCore`, which sets these attributes."""

    config: RouterSettings
    control: SpeculationControl
    load: LoadControl
    _bg: set[asyncio.Task[Any]]
    limits: SubmitLimits | None
    clock: Callable[[], float]
    requests: dict[str, Request]
    counters: Counters
    drafters: DrafterPool
    verifier: VerifierBackend
    routing: RequestRouting
    gate: DraftGate
    guard: YieldGuard
    guarding: bool
    _wakeup: asyncio.Event
    _closed: bool

    def submit(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        stop_ids: Sequence[int] = (),
        domain_hint: str = "",
        logprobs: int = NO_LOGPROBS,
        prompt_len: int = 0,
    ) -> Request:
        """``logprobs``: stream the target's log-probability of each token with this many
        alternatives (``VerifyItem.logprobs``; ``NO_LOGPROBS``: none). ``prompt_len``: how many of
        ``prompt`` are the prompt proper, the rest being output a resumed stream already has (0: all)."""
        if self._closed:
            raise RequestFailed("router shutting down", "unavailable")
        check_submission(
            request_id, prompt, max_new_tokens, sampling, stop_ids, domain_hint, self.limits, logprobs, prompt_len
        )
        if request_id in self.requests:
            raise RequestFailed(f"request_id: request {request_id} is already running", "already_exists")
        if len(self.requests) >= self.config.max_queue:
            raise RequestFailed(f"router queue is full ({self.config.max_queue} requests)", "resource_exhausted")
        guess = domain_hint or (self.routing.guess(prompt) if self.config.domain_gate else "")
        req = Request(
            request_id=request_id,
            prompt=tuple(prompt),
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            stop_ids=frozenset(stop_ids),
            domain=domain_hint,
            domain_guess=guess,
            spec=SpeculationLength(self.config.initial_k, self.config.min_k, self.config.max_k),
            ready_since=self.clock(),
            lookup=LookupIndex(self.config.lookup_max_ngram),
            first_accept=self.gate.start(guess),  # what drafting did for the recent requests of its domain
            logprobs=logprobs,
            prompt_len=prompt_len or len(prompt),
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

    def _hand_back(self, r: Request) -> None:
        """``r``'s round is over: back in the pool, or finished if it was cancelled meanwhile."""
        r.in_round = False
        r.ready_since = self.clock()
        if r.cancelled and not r.done:
            self._finish(r, FINISH_CANCELLED)

    def _finish(self, r: Request, reason: str = "", error: RequestFailed | None = None) -> None:
        if r.done:
            return
        r.done = True
        self.requests.pop(r.request_id, None)
        self.counters.requests_finished += 1
        r.events.put_nowait(Event(finished=True, finish_reason=reason, error=error))
        self._release_drafters(r)
        try:
            self.verifier.release([r.request_id])
        except Exception as exc:
            log.debug("verifier release failed", error=str(exc))

    def _release_drafters(self, r: Request) -> None:
        for d in list(r.drafter_cache):
            try:
                self.drafters.release(d, [r.request_id])
            except Exception as exc:
                log.debug("drafter release failed", drafter=d, error=str(exc))
        r.drafter_cache.clear()

    # ---- introspection -----------------------------------------------------------------------

    def queue_depth(self) -> int:
        return sum(1 for r in self.requests.values() if not r.in_round)

    def drafter_acceptance(self) -> dict[str, tuple[float, float]]:
        return {d: (v[0], v[1] / v[0] if v[0] else 0.0) for d, v in self.counters.by_drafter.items()}

    # ---- the next round's batch -------------------------------------------------------------

    def _rounds_allowed(self) -> int:
        """Rounds that may be in flight now: the configured number while pipelining pays (see
        ``SpeculationControl.pipeline_pays``), else one round with the whole pool."""
        configured = max(1, self.config.rounds_in_flight)
        if self.guarding and self.guard.plain_now:  # the yield guard's plain arm: the target alone, one pass at a time
            return 1
        if (
            configured > 1 and self.config.pipeline_control and not self.control.pipeline_pays()
        ):  # always pays without cost control
            return 1
        return configured

    def _pick(self) -> list[Request]:
        now = self.clock()
        waiting = [r for r in self.requests.values() if not r.in_round and not r.done]
        if not waiting:
            return []
        width = self.config.tree_width if self.config.fusion == "token" else max(1, self.config.drafters_per_request)
        cands = [
            Candidate(
                r.request_id,
                now - r.ready_since,
                self._k(r),
                width,
                0 if r.verifier_synced else len(r.sequence),
                (r.routing.recent_acceptance() or 0.5) * self._k(r) + 1,
                r.under_way,
            )
            for r in waiting
        ]
        cap = self.config.max_batch_requests
        allowed = self._rounds_allowed()
        if self.config.pipeline_control and allowed > 1:
            # rounds overlap: a round takes its share of the pool, so the others have a batch to draft
            cap = min(cap, max(1, -(-len(self.requests) // allowed)))
        chosen = pick_batch(cands, self.config.verify_token_budget, cap, self.config.max_k)
        batch = [self.requests[c.request_id] for c in chosen]
        for r in batch:
            r.in_round = True
        return batch

    def _holds_every_slot(self, batch: list[Request]) -> bool:
        """Whether no request outside ``batch`` could join it before one of its requests finishes:
        it holds the whole pool, or every slot while only new requests wait (requests under way
        rank first, ``scheduler.pick_batch``)."""
        ids = {r.request_id for r in batch}
        outside = [r for r in self.requests.values() if not r.done and r.request_id not in ids]
        if not outside:
            return True
        return len(batch) >= self.config.max_batch_requests and not any(r.under_way for r in outside)

    def _k(self, req: Request) -> int:
        k = req.spec.k if self.config.adaptive_k else self.config.initial_k
        return self.load.apply(k, self.config.min_k, self.config.max_k) if self.config.adaptive_k else k

    async def _verifier_failed(self, batch: list[Request], exc: Exception) -> None:
        """A verify call of ``batch`` failed (a broken stream: the verifier may be restarting): its
        requests are marked to be re-prefilled on the next verifier, or finished where they may not
        resume again, and the round pauses by the verifier's retry policy."""
        attempt = 0
        for r in batch:
            if mark_for_resume(r):
                attempt = max(attempt, r.resumes)
            else:
                self._finish(r, error=RequestFailed(f"verifier unavailable: {exc}", "unavailable"))
        try:  # whatever the verifier may still hold of them goes first, so the re-prefill starts clean
            self.verifier.release([r.request_id for r in batch if not r.done])
        except Exception as release_exc:
            log.debug("verifier release failed", error=str(release_exc))
        log.warning("verifier call failed; requests will be re-prefilled", error=str(exc), attempt=attempt)
        await asyncio.sleep(VERIFIER_RETRY.delay(attempt))

    def _background(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._bg.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._bg.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("background task failed", error=str(t.exception()))

        task.add_done_callback(done)
