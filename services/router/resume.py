"""Resuming requests on a verifier that lost them.

A verifier that restarts (or is replaced behind the same address) has no KV state; it answers a
known request with ``unknown_request``, and a broken stream fails the whole batch. Neither is the
request's fault: the router holds every committed token, so it marks the request unsynced and the
next round sends the committed sequence (prompt + generated) as a prefill. Greedy output is
unchanged: the verifier recomputes the same cache from the same tokens. A request is failed with
UNAVAILABLE only after ``MAX_RESUMES`` consecutive losses without a verdict in between.
"""

from __future__ import annotations

from typing import Any

from common.platform.retry import RetryPolicy
from common.spec.types import Verdict

MAX_RESUMES = 30  # with VERIFIER_RETRY's pauses: about a minute, long enough for a verifier to restart
# The pause before the next round after a broken verifier stream (the verifier may be restarting),
# by the requests' consecutive losses: 0.1 s doubling to 2 s.
VERIFIER_RETRY = RetryPolicy(initial_s=0.1, max_s=2.0)


def lost_by_verifier(verdict: Verdict) -> bool:
    """The verifier no longer knows the request (restart or replacement): resumable."""
    return not verdict.ok and verdict.error_kind == "unknown_request"


def mark_for_resume(req: Any) -> bool:
    """Make the next round re-prefill ``req`` on the verifier. False when it has been lost too
    many times in a row and should fail instead."""
    req.verifier_synced = False
    req.resumes += 1
    return req.resumes <= MAX_RESUMES
