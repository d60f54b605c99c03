"""The router's request pool: submission, cancellation, hand-back after a round, finishing.

A request lives in :attr:`RequestPool.requests` from :meth:`RequestPool.submit` until it finishes
(end of sequence, length, a stop token, cancellation or an error); between its rounds it waits in
the pool (``in_round`` false) for a worker of :class:`services.router.core.RouterCore` to pick it.
Finishing releases what the drafters and the verifier hold of it. The rounds themselves are
``core.py``'s; this part knows nothing of drafting or verifying.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from common.logs import get_logger
from common.spec.types import SamplingParams
from services.router.admission import SubmitLimits, check_submission
from services.router.domain import RequestRouting
from services.router.gate import DraftGate
from common.spec.lookup_index import LookupIndex
from services.router.requests import (
    FINISH_CANCELLED,
    Counters,
    DrafterPool,
    Event,
    Request,
    RequestFailed,
    VerifierBackend,
)
from services.router.settings import RouterSettings
from services.router.scheduler import SpeculationLength

log = get_logger("router")


class RequestPool:
    """The pool part of :class:`services.router.core.RouterCore`, which sets these attributes."""

    config: RouterSettings
    limits: SubmitLimits | None
    clock: Callable[[], float]
    requests: dict[str, Request]
    counters: Counters
    drafters: DrafterPool
    verifier: VerifierBackend
    routing: RequestRouting
    gate: DraftGate
    _wakeup: asyncio.Event
    _closed: bool

    def submit(self, request_id: str, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
               stop_ids: Sequence[int] = (), domain_hint: str = "") -> Request:
        if self._closed:
            raise RequestFailed("router shutting down", "unavailable")
        check_submission(request_id, prompt, max_new_tokens, sampling, stop_ids, domain_hint, self.limits)
        if request_id in self.requests:
            raise RequestFailed(f"request_id: request {request_id} is already running", "already_exists")
        if len(self.requests) >= self.config.max_queue:
            raise RequestFailed(f"router queue is full ({self.config.max_queue} requests)", "resource_exhausted")
        guess = domain_hint or (self.routing.guess(prompt) if self.config.domain_gate else "")
        req = Request(
            request_id=request_id, prompt=tuple(prompt), max_new_tokens=max_new_tokens, sampling=sampling,
            stop_ids=frozenset(stop_ids), domain=domain_hint, domain_guess=guess,
            spec=SpeculationLength(self.config.initial_k, self.config.min_k, self.config.max_k),
            ready_since=self.clock(), lookup=LookupIndex(self.config.lookup_max_ngram),
            first_accept=self.gate.start(guess),  # what drafting did for the recent requests of its domain
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
