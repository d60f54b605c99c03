"""Routing by expertise (no gRPC here).

Each request carries a routing vector: one score per live drafter, in units of "draft tokens the
target accepts per round". It is seeded from the drafters' expertise profiles for the request's
domain signal and updated after every verdict from what the drafter proposed and the target
accepted, blended with the drafter's own confidence:

    score_d <- (1 - alpha) * score_d + alpha * (accepted_d + beta * confidence_d)

Selection takes the best-scoring drafters. Explore/exploit: when the request's recent acceptance
rate falls under a threshold, the weakest selected drafter is swapped for the least-used one, so a
request stuck with the wrong experts finds better ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

DEFAULT_SCORE = 1.0  # a drafter nobody has measured yet: assume it gets a token per round


@dataclass
class RoutingVector:
    scores: dict[str, float] = field(default_factory=dict)
    uses: dict[str, int] = field(default_factory=dict)
    alpha: float = 0.3
    beta: float = 0.5
    recent: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=4))  # (accepted, drafted)

    @classmethod
    def seeded(cls, drafters: Iterable[str], prior: Mapping[str, float], alpha: float = 0.3) -> RoutingVector:
        scores = {d: float(prior[d]) if d in prior else DEFAULT_SCORE for d in drafters}
        return cls(scores=scores, uses={d: 0 for d in scores}, alpha=alpha)

    def sync(self, live: Iterable[str], prior: Mapping[str, float]) -> None:
        """Follow membership: drop drafters that left, add new ones at their prior."""
        live = set(live)
        for d in list(self.scores):
            if d not in live:
                del self.scores[d]
                self.uses.pop(d, None)
        for d in live - set(self.scores):
            self.scores[d] = float(prior[d]) if d in prior else DEFAULT_SCORE
            self.uses[d] = 0

    def recent_acceptance(self) -> float | None:
        drafted = sum(n for _, n in self.recent)
        return None if drafted == 0 else sum(a for a, _ in self.recent) / drafted

    def select(self, count: int, explore_threshold: float = 0.0) -> list[str]:
        """The ``count`` best drafters; with exploration when recent acceptance is poor."""
        ranked = sorted(self.scores, key=lambda d: (-self.scores[d], d))
        chosen = ranked[: max(1, count)]
        rate = self.recent_acceptance()
        rest = ranked[len(chosen) :]
        if rest and rate is not None and rate < explore_threshold and len(self.recent) == self.recent.maxlen:
            newcomer = min(rest, key=lambda d: (self.uses.get(d, 0), -self.scores[d], d))
            chosen = chosen[:-1] + [newcomer] if len(chosen) > 1 else chosen + [newcomer]
            self.recent.clear()  # give the new mix a fair window
        for d in chosen:
            self.uses[d] = self.uses.get(d, 0) + 1
        return chosen

    def update(
        self,
        accepted: Mapping[str, int],
        confidence: Mapping[str, float],
        participants: Iterable[str],
        accepted_total: int,
        drafted_depth: int,
    ) -> None:
        """Fold one verdict in. ``accepted``: draft tokens credited per drafter; ``confidence``:
        the drafter's mean probability for its own proposals on the fused path."""
        for d in participants:
            if d not in self.scores:
                continue
            signal = accepted.get(d, 0) + self.beta * confidence.get(d, 0.0)
            self.scores[d] = (1 - self.alpha) * self.scores[d] + self.alpha * signal
        if drafted_depth > 0:
            self.recent.append((accepted_total, drafted_depth))

    def weights(self, drafters: Iterable[str]) -> dict[str, float]:
        return {d: max(self.scores.get(d, 0.0), 1e-3) for d in drafters}
