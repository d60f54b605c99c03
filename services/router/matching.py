"""Pairing answers with the requests they belong to: by request id, never by position.

The verifier and the drafters answer a batch with one entry per item, carrying the item's
request id. A reply that drops, reorders or duplicates entries must not hand one request's
tokens to another, so the router matches by id and checks the verdict against the committed
length it expects (``committed_len`` = prompt + generated + new tokens after the verdict).
"""

from __future__ import annotations

from collections.abc import Sequence

from common.spec.token_fusion import match_draft_results
from common.spec.types import Verdict

__all__ = ["match_draft_results", "match_verdicts"]


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
                request_id=rid,
                error_kind="internal",
                error=f"verifier committed {v.committed_len} tokens for {rid}, "
                f"the router expected {before + len(v.new_tokens)}",
            )
            continue
        out[rid] = v
    return out
