"""Verdicts and draft results are paired with requests by id and checked against the committed
length, never by position."""

from __future__ import annotations

from common.spec.types import DraftResult, Verdict
from services.router.matching import match_draft_results, match_verdicts


def v(rid: str, committed: int, accepted: tuple[int, ...] = (), nxt: int = 7) -> Verdict:
    return Verdict(request_id=rid, accepted_tokens=accepted, next_token=nxt, committed_len=committed)


def test_verdicts_are_matched_by_id_not_position():
    got = match_verdicts([("a", 10), ("b", 20)], [v("b", 23, (1, 2)), v("a", 11)])
    assert got["a"].ok and got["a"].committed_len == 11
    assert got["b"].ok and got["b"].new_tokens == (1, 2, 7)


def test_missing_duplicate_or_inconsistent_verdicts_fail_only_their_request():
    got = match_verdicts([("a", 10), ("b", 20), ("c", 5)], [v("a", 12), v("b", 21), v("b", 21)])
    assert not got["a"].ok and "expected 11" in got["a"].error  # committed length disagrees
    assert not got["b"].ok and "2 verdicts" in got["b"].error
    assert not got["c"].ok and "missing" in got["c"].error
    assert all(x.error_kind == "internal" for x in got.values())


def test_failed_verdicts_pass_through():
    failed = Verdict(request_id="a", error="gone", error_kind="unknown_request")
    assert match_verdicts([("a", 3)], [failed])["a"] is failed


def test_draft_results_by_id():
    results = [DraftResult("b", (1,)), DraftResult("a", (2,))]
    got = match_draft_results(["a", "b", "c"], results)
    assert [r.token_ids if r else None for r in got] == [(2,), (1,), None]
    assert match_draft_results(["a"], None) == [None]
