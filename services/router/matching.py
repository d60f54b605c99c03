"""Pairing answers with the requests they belong to: by request id, never by position.

The verifier and the drafters answer a batch with one entry per item, carrying the item's
request id. A reply that drops, reorders or duplicates entries must not hand one request's
tokens to another, so the router matches by id and checks the verdict against the committed
length it expects (``committed_len`` = prompt + generated + new tokens after the verdict).
"""

from __future__ import annotations

from collections.abc import Sequence

from common.spec_types import DraftResult, Verdict


def match_verdicts(expected: Sequence[tuple[str, int]], verdicts: Sequence[Verdict]) -> dict[str, Verdict]:
    """``expected``: (request id, committed length before the round) per batch item. Returns one
    verdict per request id; a request whose verdict is missing, duplicated or inconsistent with its
    committed length gets a failed verdict that says why (kind ``internal``)."""
    by_id: dict[str, list[Verdict]] = {}
    for v in verdicts:
        by_id.setdefault(v.request_id, []).append(v)
    out: dict[str, Verdict] = {}
    for rid, before in expected:
        got = by_id.get(rid, [])
        if len(got) != 1:
            why = "missing" if not got else f"{len(got)} verdicts"
            out[rid] = Verdict(request_id=rid, error=f"verifier reply for {rid}: {why}", error_kind="internal")
            continue
        v = got[0]
        if v.ok and v.committed_len and v.committed_len != before + len(v.new_tokens):
            out[rid] = Verdict(
                request_id=rid, error_kind="internal",
                error=f"verifier committed {v.committed_len} tokens for {rid}, the router expected {before + len(v.new_tokens)}",
            )
            continue
        out[rid] = v
    return out


def match_draft_results(request_ids: Sequence[str], results: Sequence[DraftResult] | None) -> list[DraftResult | None]:
    """The drafter's answer for each request id in order (None where it gave none). Results
    without ids (older drafters) fall back to position when the counts agree."""
    if results is None:
        return [None] * len(request_ids)
    by_id = {r.request_id: r for r in results if r.request_id}
    if not by_id and len(results) == len(request_ids):
        return list(results)
    return [by_id.get(rid) for rid in request_ids]
