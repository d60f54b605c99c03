"""How the verifier service cuts one VerifyBatch into forward passes (no gRPC, no model).

A batch may carry more tokens than one pass should take (``--max-batch-tokens``): it is served
as consecutive slices, one pass each, and the verdicts are put back in item order. A request may
appear only once per batch; a repeat is refused before the split, since the slices are verified
separately (the engine refuses repeats within one pass with the same :func:`repeated_items`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from common.spec.types import StageTimings, Verdict, VerifyItem, VerifyOutcome


def item_tokens(item: VerifyItem) -> int:
    return len(item.append_ids) + len(item.tree) + 1


def repeated_items(items: Sequence[VerifyItem]) -> dict[int, Verdict]:
    """Index -> refusal for every item whose request id already appeared earlier in the batch."""
    seen: set[str] = set()
    out: dict[int, Verdict] = {}
    for i, item in enumerate(items):
        if item.request_id in seen:
            out[i] = Verdict(
                item.request_id,
                error=f"request_id: request {item.request_id!r} appears twice in one batch",
                error_kind="invalid",
            )
        seen.add(item.request_id)
    return out


def split_by_tokens(items: Sequence[VerifyItem], budget: int) -> list[list[VerifyItem]]:
    """Consecutive slices whose tokens stay within ``budget`` (an item larger than the budget
    goes alone: the engine's KV budget decides whether it fits at all)."""
    parts: list[list[VerifyItem]] = []
    used = 0
    for item in items:
        cost = item_tokens(item)
        if not parts or used + cost > budget:
            parts.append([])
            used = 0
        parts[-1].append(item)
        used += cost
    return parts or [[]]


def merge_outcomes(outcomes: Sequence[VerifyOutcome], refused: Mapping[int, Verdict] | None = None) -> VerifyOutcome:
    """One outcome for the whole batch: the passes' verdicts in order, with the ``refused`` ones
    (by index in the original batch) put back in their places."""
    if len(outcomes) == 1 and not refused:
        return outcomes[0]
    timings = StageTimings.sum(o.timings for o in outcomes)
    verdicts = [v for o in outcomes for v in o.verdicts]
    for index in sorted(refused or {}):
        verdicts.insert(index, refused[index])
    return VerifyOutcome(tuple(verdicts), sum(o.batch_tokens for o in outcomes), timings)
