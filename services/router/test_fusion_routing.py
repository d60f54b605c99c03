import pytest

from common.spec.fusion import DraftTree, Proposal, credit, fuse, fuse_chains
from services.router.routing import RoutingVector
from services.router.scheduler import Candidate, LoadControl, SpeculationLength, pick_batch, round_cost


def test_fuse_weights_confidence_by_routing_score():
    a = Proposal("a", (5, 6), (0.6, 0.3))
    b = Proposal("b", (7, 5), (0.9, 0.1))
    # equal weights: 7 -> 0.45, 5 -> 0.35, 6 -> 0.15
    ranked = fuse([a, b], {"a": 1.0, "b": 1.0})
    assert [c.token for c in ranked] == [7, 5, 6]
    assert ranked[0].score == pytest.approx(0.45)
    assert ranked[1].sources == {"a", "b"} and ranked[1].top1 == {"a"}
    # trust a three times more: 5 -> 0.75*0.6 + 0.25*0.1 = 0.475 beats 7 -> 0.225
    ranked = fuse([a, b], {"a": 3.0, "b": 1.0})
    assert ranked[0].token == 5 and ranked[0].score == pytest.approx(0.475)


def test_fused_steps_build_a_chain_with_sibling_leaves():
    tree = DraftTree(drafter_ids=["a", "b"])
    ranked = fuse([Proposal("a", (1, 2, 3), (0.5, 0.3, 0.2)), Proposal("b", (1, 4), (0.6, 0.4))], {"a": 1, "b": 1})
    n0 = tree.add_fused_step(-1, ranked, width=3)
    ranked = fuse([Proposal("a", (9,), (1.0,)), Proposal("b", (9,), (1.0,))], {"a": 1, "b": 1})
    n1 = tree.add_fused_step(n0, ranked, width=3)
    assert tree.tokens == [1, 4, 2, 9]
    assert tree.parents == [-1, -1, -1, 0]
    assert (n0, n1) == (0, 3)
    assert tree.depth() == 2
    assert tree.source_masks[0] == 0b11 and tree.source_masks[1] == 0b10
    assert tree.path_to(3) == [0, 3]
    assert credit(tree, [0, 3]) == {"a": 2, "b": 2}
    assert credit(tree, [1]) == {}  # 4 was only b's runner-up


def test_width_one_is_a_plain_chain():
    tree = DraftTree(drafter_ids=["a"])
    ranked = fuse([Proposal("a", (1, 2, 3), (0.5, 0.3, 0.2))], {"a": 1})
    tree.add_fused_step(-1, ranked, width=1)
    assert tree.tokens == [1] and tree.parents == [-1]


def test_chunk_fusion_merges_prefixes_most_confident_first():
    tree = fuse_chains(
        {"a": ((1, 2, 3), (0.9, 0.9, 0.9)), "b": ((1, 2, 4), (0.5, 0.5, 0.5)), "c": ((5, 6), (0.2, 0.2))},
        {"a": 1, "b": 1, "c": 1},
        width=2,
    )
    assert tree.tokens == [1, 2, 3, 4, 5, 6]
    assert tree.parents == [-1, 0, 1, 1, -1, 4]
    assert tree.top1[0] == {"a", "b"} and tree.top1[3] == {"b"}
    narrow = fuse_chains({"a": ((1, 2), (0.9, 0.9)), "b": ((3,), (0.5,))}, {"a": 1, "b": 1}, width=1)
    assert narrow.tokens == [1, 2]


def test_tree_refuses_bad_parent():
    tree = DraftTree(drafter_ids=[])
    with pytest.raises(ValueError):
        tree.add(0, 1, 0.5, frozenset(), frozenset())


def test_routing_prefers_experts_and_learns_from_verdicts():
    rv = RoutingVector.seeded(["code", "prose", "math"], {"code": 3.0, "prose": 1.0, "math": 0.5})
    assert rv.select(2) == ["code", "prose"]
    # code keeps failing, math keeps succeeding
    for _ in range(10):
        rv.update({"math": 4}, {"math": 0.9, "code": 0.2}, ["code", "math"], accepted_total=4, drafted_depth=4)
    assert rv.scores["math"] > rv.scores["code"]
    assert rv.select(1) == ["math"]


def test_routing_explores_when_acceptance_drops():
    rv = RoutingVector.seeded(["a", "b", "c"], {"a": 3.0, "b": 2.0, "c": 1.0})
    for _ in range(4):
        rv.update({}, {}, [], accepted_total=0, drafted_depth=4)
    chosen = rv.select(2, explore_threshold=0.5)
    assert "c" in chosen and "a" in chosen  # the least-used drafter replaces the weaker one


def test_routing_follows_membership():
    rv = RoutingVector.seeded(["a", "b"], {"a": 2.0})
    assert rv.scores["b"] == 1.0  # unknown drafter starts at the default
    rv.sync(["b", "c"], {"c": 5.0})
    assert set(rv.scores) == {"b", "c"} and rv.select(1) == ["c"]


def test_batch_respects_budget_and_never_starves():
    c = [Candidate(f"r{i}", wait_s=i * 0.1, k=4, width=2, append_tokens=0, expected_tokens=2.0) for i in range(6)]
    assert round_cost(c[0]) == 9
    batch = pick_batch(c, token_budget=27, max_requests=16, k_max=8)
    assert [b.request_id for b in batch] == ["r5", "r4", "r3"]  # oldest first, 3 fit
    huge = Candidate("big", wait_s=10.0, k=4, width=2, append_tokens=5000, expected_tokens=1.0)
    assert [b.request_id for b in pick_batch([huge, *c], token_budget=27, max_requests=16, k_max=8)][0] == "big"
    assert len(pick_batch(c, token_budget=10**6, max_requests=2, k_max=8)) == 2


def test_requests_under_way_keep_their_slots_and_new_ones_wait_in_arrival_order():
    new = [Candidate(f"n{i}", wait_s=1.0 + i, k=4, width=1, append_tokens=20, expected_tokens=3.0) for i in range(3)]
    running = [
        Candidate(f"u{i}", wait_s=0.0, k=4, width=1, append_tokens=0, expected_tokens=1.0, started=True)
        for i in range(2)
    ]
    batch = pick_batch([*new, *running], token_budget=10**6, max_requests=4, k_max=8)
    assert [b.request_id for b in batch] == ["u0", "u1", "n2", "n1"]  # then the longest waiting new ones


def test_speculation_length_follows_acceptance():
    s = SpeculationLength(k=4, min_k=1, max_k=5)
    assert s.update(4, 4) == 5 and s.update(5, 5) == 5
    assert s.update(1, 5) == 4 and s.update(3, 4) == 4
    for _ in range(10):
        s.update(0, 4)
    assert s.k == 1


def test_load_control_speculates_more_when_verifier_idles():
    lc = LoadControl()
    for _ in range(20):
        lc.observe(0.2)
    assert lc.scale > 1.0 and lc.apply(4, 1, 8) >= 5
    for _ in range(200):
        lc.observe(1.0)
    assert lc.scale < 1.0 and lc.apply(4, 1, 8) <= 3


def test_domain_signal_prefers_specialists():
    from services.router.domain import infer_domain

    domains = {"code": ["code"], "prose": ["prose"], "generalist": ["code", "prose"]}
    assert infer_domain({"code": -3.0, "prose": -1.0, "generalist": -0.5}, domains) == "prose"
    assert infer_domain({"generalist": -0.5}, domains) == "code"
    assert infer_domain({"x": -1.0}, {"x": []}) == "x"
    assert infer_domain({}, domains) == ""


def test_measured_zero_is_not_mistaken_for_unknown():
    rv = RoutingVector.seeded(["a", "b"], {"a": 0.0})
    assert rv.scores == {"a": 0.0, "b": 1.0}
