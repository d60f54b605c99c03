"""Batch scheduling and speculation-length control (no gRPC here).

Batch scheduling: the router picks the requests of the next round to maximise a weighted sum of
latency urgency and expected accepted tokens, under the verifier's token budget per pass:

    priority(r) = w_wait * wait_s(r) / (1 + wait_s(r)) * 2 + w_gain * expected_tokens(r) / k_max

Requests already under way rank before every new one (continuous batching): a new request takes
a slot of the batch when one is free, the longest waiting first. Under overload the pool holds
more requests than a round takes; ranking by priority alone would rotate them all through the
batch (processor sharing), so every request would finish late, near the end of the backlog, and
the verifier would hold the caches of all of them at once; first come, first served finishes
the early ones at the target's own pace.

``expected_tokens`` follows the request's acceptance history. Cost of a request in a verify pass
is its tree size plus the tokens it appends (the prompt on its first round).

Speculation length: per request, k follows acceptance (all drafted tokens accepted -> k + 1, less
than half -> k - 1), bounded by [min_k, max_k]. The global load hook :class:`LoadControl` scales
speculation by verifier idleness: idle verifier -> longer k and more drafters per request,
backlogged verifier -> shorter (the adaptive controller of a later stage plugs in here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """What the scheduler needs to know of a request waiting for a round."""

    request_id: str
    wait_s: float  # since its last round ended (or since arrival)
    k: int
    width: int
    append_tokens: int
    expected_tokens: float  # expected accepted draft tokens + 1 next token
    started: bool = False  # has had a round (holds a slot of the running batch)


def round_cost(c: Candidate) -> int:
    # tree: the fused chain of k nodes plus up to (width - 1) siblings per level, + appended tokens + 1
    return c.k * max(1, c.width) + c.append_tokens + 1


def pick_batch(
    waiting: Sequence[Candidate],
    token_budget: int,
    max_requests: int,
    k_max: int,
    w_wait: float = 1.0,
    w_gain: float = 1.0,
) -> list[Candidate]:
    """Greedy knapsack by priority, requests under way first. The first of the ranking is always
    taken, even over budget, so nothing starves behind a long prompt."""

    def priority(c: Candidate) -> float:
        return w_wait * 2 * c.wait_s / (1.0 + c.wait_s) + w_gain * c.expected_tokens / max(1, k_max)

    ranked = sorted(waiting, key=lambda c: (not c.started, -priority(c), c.request_id))
    batch: list[Candidate] = []
    used = 0
    for c in ranked:
        if len(batch) >= max_requests:
            break
        cost = round_cost(c)
        if batch and used + cost > token_budget:
            continue
        batch.append(c)
        used += cost
    return batch


@dataclass
class SpeculationLength:
    """Per-request k from its acceptance history."""

    k: int
    min_k: int
    max_k: int

    def update(self, accepted: int, drafted: int) -> int:
        if drafted <= 0:
            return self.k
        if accepted >= drafted:
            self.k = min(self.max_k, self.k + 1)
        elif accepted * 2 < drafted:
            self.k = max(self.min_k, self.k - 1)
        return self.k


@dataclass
class LoadControl:
    """Hook for adaptive speculation control: a multiplier on k and on drafters per request,
    driven by the verifier's busy fraction. Negative feedback: idle -> more speculation."""

    target_busy: float = 0.85
    gain: float = 0.5
    scale: float = 1.0
    min_scale: float = 0.5
    max_scale: float = 1.5

    def observe(self, verifier_busy_frac: float) -> float:
        error = self.target_busy - verifier_busy_frac  # > 0: verifier idles -> speculate more
        self.scale = min(self.max_scale, max(self.min_scale, self.scale + self.gain * error * 0.1))
        return self.scale

    def apply(self, k: int, min_k: int, max_k: int) -> int:
        return max(min_k, min(max_k, round(k * self.scale)))


PLAIN_STREAK = 2  # rounds in a row with nothing drafted before a request's rounds are taken as plain steps


def plain_steps(limit: int, remaining: Sequence[int], streaks: Sequence[int], drafts: bool, whole_pool: bool) -> int:
    """How many tokens the verifier decodes for a round before it answers (``VerifyItem.plain_steps``).

    A round that drafts nothing and holds every request of the pool (or every slot, with only new
    requests waiting, which take a slot only once one is free), whose requests have not drafted
    for a while either, has its next rounds known: plain decode steps of the same batch. The verifier
    runs up to ``limit`` of them back to back, and the round trips between them (the reply, the
    router's work on it, the next batch) are saved. Each request's ``streaks`` (its latest rounds
    in a row with nothing drafted, this one not counted) must reach :data:`PLAIN_STREAK`: a request
    whose lookup chains come and go would lose the chains of the rounds the steps replace, which
    are worth far more than a round trip. Never past the request with the fewest ``remaining``
    tokens, so no slot of the batch idles once its request is done; 1 whenever the round drafts or
    a request that could take a slot waits outside it (a request that arrives meanwhile waits for
    the steps, which is why ``limit`` is small). The router also passes ``whole_pool`` false for the
    round after a request left the pool while the batch has room: a closed-loop client sends its
    next request as soon as the last one ends, and it should join after one pass, not after all the
    steps (``RouterCore._round``).
    """
    if limit <= 1 or drafts or not whole_pool or not remaining or min(streaks, default=0) < PLAIN_STREAK:
        return 1
    return max(1, min(limit, min(remaining)))
