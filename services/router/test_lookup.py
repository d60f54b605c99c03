"""The lookup drafter: proposals from a request's own text, their calibration and their place in the tree."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from common.spec.fusion import DraftTree
from common.spec.types import GREEDY
from services.router.control import SpeculationControl
from services.router.lookup import (
    LOOKUP_ID,
    LookupCalibration,
    add_lookup_chain,
    lookup_only,
    observe_lookup,
)
from services.router.lookup_drafting import LookupDrafting
from services.router.requests import Counters
from services.router.settings import RouterSettings
from services.router.test_control import stepped


def test_calibration_starts_from_priors_and_learns_per_match_length_and_depth():
    cal = LookupCalibration(max_ngram=4)
    assert cal(True, 1, 0) < cal(True, 2, 0) < cal(True, 4, 0)  # a longer match is likelier right
    assert cal(True, 9, 0) == cal(True, 4, 0)  # matches beyond max_ngram share the longest's estimate
    for _ in range(200):
        cal.observe(True, 4, 0, True)
        cal.observe(True, 1, 0, False)
    assert cal(True, 4, 0) > 0.95 and cal(True, 1, 0) < 0.05
    assert cal(False, 4, 0) == pytest.approx(LookupCalibration.prior(4, 0))  # sampling learns on its own
    assert cal(True, 4, 7) == cal(True, 4, 3)  # deep nodes share one estimate


def drafted_tree() -> DraftTree:
    """The drafters' fused chain 10 -> 11 with a runner-up 20 at the root."""
    tree = DraftTree(drafter_ids=["a"])
    n0 = tree.add(-1, 10, 0.9, frozenset({"a"}), frozenset({"a"}))
    tree.add(-1, 20, 0.2, frozenset({"a"}), frozenset({"a"}))
    tree.add(n0, 11, 0.8, frozenset({"a"}), frozenset({"a"}))
    return tree


def test_a_lookup_chain_shares_the_drafters_nodes_and_branches_where_it_differs():
    tree = drafted_tree()
    cal = LookupCalibration()
    for _ in range(50):  # a trusted 3-token match
        for depth in range(4):
            cal.observe(True, 3, depth, True)
    got = add_lookup_chain(tree, [10, 12, 13], 3, True, cal, threshold=0.1, width=2)
    assert got.nodes[0] == 0  # shared with the drafters' node: credited to both
    assert tree.top1[0] == {"a", LOOKUP_ID} and tree.source_masks[0] == 0b11
    assert [tree.tokens[n] for n in got.nodes] == [10, 12, 13]
    assert tree.parents[got.nodes[1]] == 0 and tree.parents[got.nodes[2]] == got.nodes[1]
    assert lookup_only(tree, [got]) == {got.nodes[1], got.nodes[2]}
    assert tree.depth() == 3 and tree.depth(without=lookup_only(tree, [got])) == 2


def test_a_lookup_chain_stops_where_it_no_longer_pays_or_its_level_is_full():
    cal = LookupCalibration()  # priors: a first token after a 1-token match is right 30% of the time
    tree = drafted_tree()
    assert add_lookup_chain(tree, [30, 31], 1, True, cal, threshold=0.5, width=2).nodes == ()
    assert len(tree) == 3
    got = add_lookup_chain(tree, [30, 31, 32], 1, True, cal, threshold=0.2, width=2)
    assert [tree.tokens[n] for n in got.nodes] == [30, 31]  # 0.3, then 0.3 * 0.7 = 0.21, then 0.147 < 0.2
    full = drafted_tree()
    add_lookup_chain(full, [30], 4, True, cal, threshold=0.0, width=2)  # width + 1 siblings at the root now
    assert add_lookup_chain(full, [40], 4, True, cal, threshold=0.0, width=2).nodes == ()


def test_observe_counts_the_accepted_prefix_and_calibrates_only_tried_nodes():
    cal = LookupCalibration()
    tree = drafted_tree()
    got = add_lookup_chain(tree, [10, 12, 13], 2, True, cal, threshold=0.0, width=2)
    before = {d: cal(True, 2, d) for d in range(3)}
    # the target took 10 then 12, and rejected 13
    assert observe_lookup(cal, tree, got, [got.nodes[0], got.nodes[1]]) == 2
    assert cal(True, 2, 0) > before[0] and cal(True, 2, 1) > before[1] and cal(True, 2, 2) < before[2]
    # the target rejected 10: nothing deeper was tried, so only depth 0 learns
    seen = {d: cal(True, 2, d) for d in range(3)}
    assert observe_lookup(cal, tree, got, [1]) == 0
    assert cal(True, 2, 0) < seen[0] and cal(True, 2, 1) == seen[1] and cal(True, 2, 2) == seen[2]


def test_the_plain_steps_draft_as_deep_as_each_row_repays_at_its_depth():
    """A request's first draft row is its dearest (31 ms on this curve, 3 ms for each later one):
    priced at its depth, a chain the first row is worth goes on where the later rows are worth it,
    and a chain whose calibration fell short of the first row's price is not drafted at all."""
    control = stepped(SpeculationControl())
    drafting = LookupDrafting(
        RouterSettings(step_lookup=True, lookup_drafts=True, speculate=True, lookup_corpus=False), control, Counters()
    )
    cal = drafting.calibration
    for i in range(400):  # a 4-token match: its first token right 90% of the time, each later one 50%
        for depth, rate in enumerate((0.9, 0.5, 0.5, 0.5)):
            cal.observe(True, 4, depth, i % 10 < rate * 10)
    first = control.first_row_threshold(1)
    assert 0.5 < first < 0.9  # the first token repays its row; a later one would not at that price
    text, _corpus = drafting.at_steps([SimpleNamespace(sampling=GREEDY)])[True]
    flat_price = drafting.step_depths(True, (first,))[0]
    assert flat_price[3] == 1  # every depth at the first row's price: the chain stops after one token
    assert text[3] > 1  # at its own depth a later row costs a tenth of that, and its 0.45 repays it
    for i in range(400):  # a 1-token match whose first token is right 1 time in 20
        cal.observe(True, 1, 0, i % 20 == 0)
    assert drafting.at_steps([SimpleNamespace(sampling=GREEDY)])[True][0][0] == 0
