"""Every greedy output of a bench run against the target's own decode: a single differing token
fails the run (:class:`GreedyMismatch`), with where the first difference is and the tokens around it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class BenchError(RuntimeError):
    pass


class GreedyMismatch(BenchError):
    """A greedy run produced a token the target alone would not have."""


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b)) if len(a) != len(b) else -1


def check_greedy(
    system: str,
    workload: str,
    records: Sequence[Any],
    expected: dict[tuple[int, ...], tuple[int, ...]],
    prompts: dict[int, tuple[int, ...]],
) -> list[dict[str, Any]]:
    """Mismatches between greedy outputs and the target's own decode (empty when all equal)."""
    bad = []
    for rec in records:
        if rec.error:
            continue
        want = expected[prompts[rec.index]]
        got = tuple(rec.token_ids)
        if got != want:
            pos = first_divergence(got, want)
            bad.append(
                {
                    "system": system,
                    "workload": workload,
                    "request": rec.index,
                    "domain": rec.domain,
                    "position": pos,
                    "expected": list(want[max(0, pos - 2) : pos + 3]),
                    "got": list(got[max(0, pos - 2) : pos + 3]),
                    "expected_len": len(want),
                    "got_len": len(got),
                }
            )
    return bad


def mismatch_text(bad: Sequence[dict[str, Any]]) -> str:
    b = bad[0]
    return (
        f"GREEDY OUTPUT MISMATCH: {len(bad)} request(s) of {b['system']} on {b['workload']} differ from the target's "
        "own "
        f"greedy decode; first: request {b['request']} ({b['domain']}) at token {b['position']}: "
        f"expected ...{b['expected']}..., got ...{b['got']}... (lengths {b['expected_len']} vs {b['got_len']})"
    )


# ---- table ----------------------------------------------------------------------------------------
