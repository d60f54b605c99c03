"""Statistics for the losslessness tests: total-variation distance against a simulated null.

``tv_check(counts, probs, seed)`` compares an empirical outcome histogram with the exact outcome
distribution. The acceptance threshold is the largest TV distance seen in ``null_runs`` samples
of the same size drawn from the exact distribution itself (times a small slack), so it adapts to
the number of outcomes and the sample size, and a fixed seed makes the test deterministic.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch


def total_variation(counts: Mapping[Hashable, int], probs: Mapping[Hashable, float]) -> float:
    n = sum(counts.values())
    keys = set(counts) | set(probs)
    return 0.5 * sum(abs(counts.get(k, 0) / n - probs.get(k, 0.0)) for k in keys)


def null_tv_threshold(
    probs: Mapping[Hashable, float], n: int, seed: int, null_runs: int = 200, slack: float = 1.1
) -> float:
    keys = list(probs)
    p = torch.tensor([probs[k] for k in keys], dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    worst = 0.0
    for _ in range(null_runs):
        draws = torch.multinomial(p, n, replacement=True, generator=g)
        hist = torch.bincount(draws, minlength=len(keys)).tolist()
        counts = {keys[i]: c for i, c in enumerate(hist) if c}
        worst = max(worst, total_variation(counts, probs))
    return worst * slack


def tv_check(counts: Mapping[Hashable, int], probs: Mapping[Hashable, float], seed: int = 0) -> tuple[float, float]:
    """Return ``(tv, threshold)``; the sample is consistent with ``probs`` when ``tv <= threshold``."""
    n = sum(counts.values())
    return total_variation(counts, probs), null_tv_threshold(probs, n, seed)
