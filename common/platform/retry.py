"""The one retry policy of the project, on tenacity: every caller that reconnects or sends a call
again waits as :class:`RetryPolicy` says (exponential from ``initial_s``, capped at ``max_s``,
each pause stretched by a random factor so that callers cut by the same failure do not come back
in step) and states itself what it retries and until when::

    async for attempt in POLICY.retrying(retry=retry_if_exception_type(NotYet), stop=stop_after_attempt(4)):
        with attempt:
            ...

A caller that is not a loop around one call (a round that returns and is scheduled again, a
watcher that restarts processes) asks :meth:`RetryPolicy.delay` for its pause instead.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tenacity import AsyncRetrying, RetryCallState, Retrying, stop_never, wait_exponential
from tenacity.retry import RetryBaseT
from tenacity.stop import StopBaseT
from tenacity.wait import wait_base

__all__ = ["RetryPolicy"]


class _wait_spread(wait_base):
    """tenacity's capped exponential wait, stretched by a random factor in ``[1, 1 + jitter)``:
    never shorter than the plain exponential, so a caller keeps at least the patience it had."""

    def __init__(self, initial_s: float, max_s: float, jitter: float) -> None:
        self.exponential = wait_exponential(multiplier=initial_s, max=max_s)
        self.jitter = jitter

    def __call__(self, retry_state: RetryCallState) -> float:
        return self.exponential(retry_state) * (1.0 + random.uniform(0.0, self.jitter))


@dataclass(frozen=True)
class RetryPolicy:
    """Pauses of ``initial_s * 2**(n - 1)`` seconds after the n-th failure, at most ``max_s``,
    each stretched by up to ``jitter`` (a fraction) at random."""

    initial_s: float
    max_s: float
    jitter: float = 0.2

    def wait(self) -> wait_base:
        return _wait_spread(self.initial_s, self.max_s, self.jitter)

    def delay(self, failures: int) -> float:
        """The pause after ``failures`` failures in a row (0: half of ``initial_s``)."""
        state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
        state.attempt_number = failures
        return self.wait()(state)

    def retrying(
        self,
        *,
        retry: RetryBaseT,
        stop: StopBaseT = stop_never,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        **kwargs: Any,
    ) -> AsyncRetrying:
        """Attempts for an asyncio caller; the last failure is raised as it is (``reraise``)."""
        if sleep is not None:
            kwargs["sleep"] = sleep
        return AsyncRetrying(wait=self.wait(), retry=retry, stop=stop, reraise=True, **kwargs)

    def retrying_sync(
        self,
        *,
        retry: RetryBaseT,
        stop: StopBaseT = stop_never,
        sleep: Callable[[float], None] | None = None,
        **kwargs: Any,
    ) -> Retrying:
        """Attempts for a blocking caller; the last failure is raised as it is (``reraise``)."""
        if sleep is not None:
            kwargs["sleep"] = sleep
        return Retrying(wait=self.wait(), retry=retry, stop=stop, reraise=True, **kwargs)
