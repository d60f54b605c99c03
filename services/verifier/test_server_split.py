from common.runtime.batching import merge_outcomes, repeated_items, split_by_tokens
from common.spec.types import StageTimings, TokenTree, Verdict, VerifyItem, VerifyOutcome


def test_batches_are_split_by_token_budget_in_order():
    items = [
        VerifyItem("a", (1,) * 5),
        VerifyItem("b", tree=TokenTree.chain([1, 2, 3])),
        VerifyItem("c", (1,) * 20),
        VerifyItem("d"),
    ]
    parts = split_by_tokens(items, budget=10)
    assert [[i.request_id for i in p] for p in parts] == [["a", "b"], ["c"], ["d"]]
    assert split_by_tokens([], 10) == [[]]


def test_outcomes_merge_in_order():
    t = StageTimings(1, 2, 3, 6)
    merged = merge_outcomes([VerifyOutcome((Verdict("a"),), 4, t), VerifyOutcome((Verdict("b"), Verdict("c")), 5, t)])
    assert [v.request_id for v in merged.verdicts] == ["a", "b", "c"]
    assert merged.batch_tokens == 9 and merged.timings == StageTimings(2, 4, 6, 12)


def test_a_repeat_is_refused_even_when_the_split_would_part_it_from_the_first():
    """A request twice in one batch would be verified twice if the token budget put its two items
    in different passes (the engine only sees repeats within one pass)."""
    items = [VerifyItem("a", (1,) * 8), VerifyItem("b", (1,) * 8), VerifyItem("a", (2,)), VerifyItem("c", (3,))]
    refused = repeated_items(items)
    assert list(refused) == [2] and refused[2].error_kind == "invalid" and refused[2].error.startswith("request_id: ")
    todo = [it for i, it in enumerate(items) if i not in refused]
    t = StageTimings(1, 1, 1, 3)
    outcomes = [
        VerifyOutcome(tuple(Verdict(it.request_id) for it in part), 1, t) for part in split_by_tokens(todo, budget=10)
    ]
    merged = merge_outcomes(outcomes, refused)
    assert [(v.request_id, v.ok) for v in merged.verdicts] == [("a", True), ("b", True), ("a", False), ("c", True)]
