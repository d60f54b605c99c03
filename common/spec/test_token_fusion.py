"""The token-fusion loop on hand-written answers: steps, pricing and a drafter failing mid-round."""

from __future__ import annotations

from common.spec.token_fusion import FusionRequest, FusionSource, StepPricing, TokenFusion
from common.spec.types import DraftItem, DraftResult


def request(rid: str, steps: int, drafters: dict[str, float], committed: int = 5) -> FusionRequest:
    return FusionRequest(
        rid,
        steps,
        tuple(
            FusionSource(d, w, DraftItem(rid, append_ids=tuple(range(committed))), committed)
            for d, w in drafters.items()
        ),
    )


def answer(
    items: list[DraftItem], cache_len: dict[str, int], token: int, prob: float, **errors: str
) -> list[DraftResult]:
    return [
        DraftResult(
            i.request_id,
            token_ids=(token, token + 1),
            probs=(prob, 1 - prob),
            cache_len=cache_len[i.request_id],
            error=errors.get(i.request_id, ""),
        )
        for i in items
    ]


def test_every_drafter_appends_the_fused_token_and_a_failed_one_leaves_the_round():
    loop = TokenFusion([request("r", 3, {"a": 1.0, "b": 3.0})], width=2, pricing=StepPricing())
    calls = loop.step()
    assert {d: [i.append_ids for i in items] for d, items in calls.items()} == {
        "a": [(0, 1, 2, 3, 4)],
        "b": [(0, 1, 2, 3, 4)],
    }
    assert all(i.top_n == 2 for items in calls.values() for i in items)
    # b weighs three times a: b's token wins, a's becomes a sibling
    loop.take({"a": answer(calls["a"], {"r": 5}, 10, 0.9), "b": answer(calls["b"], {"r": 5}, 20, 0.9)})
    out = loop.outcomes["r"]
    assert out.fused == [20] and out.tree.tokens[0] == 20 and 10 in out.tree.tokens
    calls = loop.step()
    assert [i.append_ids for i in calls["a"]] == [(20,)] == [i.append_ids for i in calls["b"]]
    loop.take({"a": answer(calls["a"], {"r": 6}, 30, 0.8), "b": None})  # b's process is gone
    assert out.failed == {"b": "no answer"} and out.cache_len == {"a": 6}
    assert out.fused == [20, 30]
    calls = loop.step()
    assert list(calls) == ["a"]
    loop.take({"a": answer(calls["a"], {"r": 99}, 40, 0.8)})  # a cache that is not where it should be
    assert "a" in out.failed and out.cache_len == {} and loop.done
    assert out.fused == [20, 30]


def test_pricing_cuts_nodes_that_do_not_repay_their_row_and_steps_that_do_not_repay_their_time():
    # calibration: confidence under 0.5 is accepted 20% of the time, above 80%
    pricing = StepPricing(priced=True, threshold=0.3, calibration=(0.2, 0.8), step_tokens=0.5, row_tokens=0.1)
    assert pricing.node_value(1.0, 0.9) == 0.8 and pricing.node_value(0.5, 0.1) == 0.1
    assert pricing.worth_a_step([0.7]) and not pricing.worth_a_step([0.55])
    loop = TokenFusion([request("r", 8, {"a": 1.0})], width=2, pricing=pricing)
    values = []
    while not loop.done:
        calls = loop.step()
        loop.take({"a": answer(calls["a"], {"r": 5 + len(values)}, 10 + len(values), 0.9)})
        values.append(0.8 ** len(values))
    out = loop.outcomes["r"]
    # 0.8 and 0.64 repay a step (>= 0.6); 0.512 does not: three nodes, each with no sibling worth its row
    assert out.fused == [10, 11, 12] and out.tree.tokens == [10, 11, 12]
    unpriced = TokenFusion([request("r", 2, {"a": 1.0})], width=2, pricing=StepPricing())
    while not unpriced.done:
        calls = unpriced.step()
        unpriced.take({"a": answer(calls["a"], {"r": 5 + unpriced.taken}, 10, 0.01)})
    assert len(unpriced.outcomes["r"].tree) == 4  # two steps, each winner and its sibling
