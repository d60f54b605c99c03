from common.spec_types import StageTimings, TokenTree, Verdict, VerifyItem, VerifyOutcome
from services.verifier.server import merge_outcomes, split_by_tokens


def test_batches_are_split_by_token_budget_in_order():
    items = [VerifyItem("a", (1,) * 5), VerifyItem("b", tree=TokenTree.chain([1, 2, 3])), VerifyItem("c", (1,) * 20), VerifyItem("d")]
    parts = split_by_tokens(items, budget=10)
    assert [[i.request_id for i in p] for p in parts] == [["a", "b"], ["c"], ["d"]]
    assert split_by_tokens([], 10) == [[]]


def test_outcomes_merge_in_order():
    t = StageTimings(1, 2, 3, 6)
    merged = merge_outcomes([VerifyOutcome((Verdict("a"),), 4, t), VerifyOutcome((Verdict("b"), Verdict("c")), 5, t)])
    assert [v.request_id for v in merged.verdicts] == ["a", "b", "c"]
    assert merged.batch_tokens == 9 and merged.timings == StageTimings(2, 4, 6, 12)
